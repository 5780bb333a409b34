"""The on-prem client retries a 429, against the real server over 127.0.0.1.

A 429 says one of the server's per-tenant limits is full and the request was not acted on, so
the client waits and sends it again (``busy_retries``, with backoff) rather than failing the
caller's step. Here the tenant's unfinished ops (``--max-pending-mb-per-tenant``, 1 MiB) are
full: an op the test queued behind one held on a gate. Once the gate opens and they finish, the
client's retried forward-backward is accepted and runs, once; with no retries the 429 reaches the
caller, naming the limit. The same holds for a 429 sent while the body is still arriving (the
tenant's ``--max-uploads-per-tenant`` bodies being read): the server reads the rest of the body
and discards it (uvicorn does), so the client sees the 429, not a broken connection.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from arctic_platform.client import ServerError, SyncArcticRLClient
from arctic_platform.client.config import load_config
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.service import Service, ServiceSettings
from tests.client.conftest import TINY, backend_config, make_app
from tests.live_server import serve_app
from tests.server.test_hostile_uploads import lying_upload
from tests.waiting import wait_until

# A forward-backward body of about 500 KB: 72 rows of 256 tokens in four arrays.
ROWS, WIDTH = 72, 256


def _body(seed: int) -> dict:
    """A GRPO forward-backward's body (its old log-probs: the current weights')."""
    ids = np.random.default_rng(seed).integers(5, 60, (ROWS, WIDTH))
    ones = np.ones((ROWS, WIDTH), np.int64)
    response = ones.copy()
    response[:, 0] = 0  # the first token has no log-prob to train
    batch = {
        "input_ids": ids,
        "attention_mask": ones,
        "response_mask": response,
        "advantages": np.ones((ROWS, WIDTH), np.float32),
    }
    return {"batch": batch, "processing": {"loss_fn": "verl_grpo", "config": CURRENT}}


CURRENT = {"old_log_probs": "current"}


@pytest.fixture
def busy_server(tmp_path):
    """A server whose tenant limits are 1 MiB of unfinished ops and one body being read at
    once, and a gate the test holds."""
    limits = ServerLimits(max_pending_mb_per_tenant=1, max_uploads_per_tenant=1)
    service = Service(ServiceSettings(data_dir=tmp_path / "data", device="cpu", limits=limits))
    gate = threading.Event()
    try:
        with serve_app(make_app(service)) as url:
            yield service, url, gate
    finally:
        gate.set()
        service.close()


def _client(url: str, data_dir, **backend) -> SyncArcticRLClient:
    config = load_config(
        {
            "model": TINY,
            "seed": 0,
            "backend": backend_config("http", url, data_dir, **backend),
            "training": {"optimizer": {"lr": 1e-3}},
        }
    )
    return SyncArcticRLClient(config)


def _fill(service: Service, gate: threading.Event, job_id: str) -> None:
    """Hold the job's queue on the gate, with two bodies of ours (1 MiB) waiting behind it."""
    sub = service.resolve(job_id, owner=None, kind="training")
    service.executor.submit_runner(sub, "step", lambda: gate.wait(120))
    for seed in range(2):
        service.submit(sub, "forward-backward", _body(seed))


def test_a_429_is_retried_until_the_server_takes_the_op(busy_server, tmp_path, caplog):
    service, url, gate = busy_server
    caplog.set_level(logging.INFO, logger="arctic_platform.client")
    with _client(url, tmp_path / "client") as client:
        _fill(service, gate, client.training_job_id)
        threading.Timer(1.0, gate.set).start()
        out = client.fwd_bwd(_body(9))
        assert np.isfinite(out["loss"])
        assert any("busy (429" in r.getMessage() for r in caplog.records), caplog.text
        wait_until(lambda: service.pending.held(None) == 0, what="every op finished")


def test_a_429_sent_mid_body_is_retried_too(busy_server, tmp_path, caplog):
    """A stalled upload of the same tenant holds its one upload slot, so the client's body is
    refused part-way through; the client reads that 429 and retries once the slot is free."""
    service, url, _ = busy_server
    caplog.set_level(logging.INFO, logger="arctic_platform.client")
    with _client(url, tmp_path / "client") as client:
        path = f"/forward-backward?job_id={client.training_job_id}"
        stalled = lying_upload(url, path, "application/octet-stream", claimed=1 << 20)
        threading.Timer(1.0, stalled.close).start()
        out = client.fwd_bwd(_body(9))
        assert np.isfinite(out["loss"])
        assert any("busy (429" in r.getMessage() for r in caplog.records), caplog.text
        ran = service.metrics.registry.get_sample_value(
            "arctic_ops_total", {"op": "forward-backward", "status": "ok"}
        )
        assert ran == 1


def test_without_retries_the_429_reaches_the_caller(busy_server, tmp_path):
    service, url, gate = busy_server
    with _client(url, tmp_path / "client", busy_retries=0) as client:
        _fill(service, gate, client.training_job_id)
        with pytest.raises(ServerError, match="max-pending-mb-per-tenant") as refused:
            client.fwd_bwd(_body(9))
        assert refused.value.status == 429


@pytest.mark.parametrize("value", [-1, "often", 1.5])
def test_a_bad_busy_retries_is_refused_naming_it(tmp_path, value):
    with pytest.raises(ValueError, match="busy_retries"):
        load_config(
            {
                "model": TINY,
                "backend": backend_config(
                    "http", "http://127.0.0.1:1", tmp_path, busy_retries=value
                ),
            }
        )
