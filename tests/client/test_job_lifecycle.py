"""The job lifecycle is the client's, driven once through the job ops on every backend.

Against a real Service (FakeEngine jobs whose build waits on a gate) over each surface: a client
waits for its job with one long-polled ``get-job`` and the routes refuse a bad ``wait_s`` naming
it. Against a scripted transport (a stand-in whose job answers the test chooses): a job that never
runs, or fails, is cancelled before the error reaches the caller; an attached client never
cancels; closing cancels each created job once.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from arctic_platform.client import (
    ConflictError,
    NotFoundError,
    RequestTimeoutError,
    SyncArcticRLClient,
    Transport,
    make_transport,
)
from arctic_platform.client.config import load_config
from arctic_platform.client.transport import Request
from arctic_platform.contract.ops import OpName
from arctic_platform.server.cortex import PREFIX
from arctic_platform.server.service import Service, ServiceSettings
from tests.client.conftest import TINY, Recording, backend_config
from tests.fake_engine import build_fake_engine, gated_builder
from tests.live_server import serve_app
from tests.server.conftest import make_app
from tests.waiting import wait_until

CORTEX = PREFIX.format(database="DB", schema="RL", endpoint="cortex-training")


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """A FakeEngine Service served on 127.0.0.1 whose engines are built once ``gate`` is set."""
    gate = threading.Event()

    service = Service(
        ServiceSettings(data_dir=tmp_path_factory.mktemp("server"), device="cpu"),
        engine_builder=gated_builder(build_fake_engine, gate),
    )
    with serve_app(make_app(service)) as url:
        yield service, url, gate
    gate.set()
    service.close()


@pytest.mark.parametrize("surface", ["inprocess", "http", "cortex"])
def test_a_client_waits_for_its_job_with_one_long_poll(gated, tmp_path, surface):
    service, url, gate = gated
    gate.clear()
    backend = backend_config(surface, url, tmp_path)
    config = load_config({"model": TINY, "seed": 0, "backend": backend, "sampling": {}})
    recording = Recording(make_transport(config, service if surface == "inprocess" else None))
    made: dict[str, Any] = {}
    creating = threading.Thread(
        target=lambda: made.setdefault("client", SyncArcticRLClient(config, transport=recording))
    )
    creating.start()
    wait_until(lambda: any(j["status"] == "initializing" for j in service.list_jobs()))
    threading.Event().wait(1.5)  # a client polling on its own would have asked several times
    gate.set()
    creating.join(timeout=60)
    client = made["client"]
    try:
        # One create, then one get-job per job made (the on-prem API makes one per sub-job).
        assert recording.requests[0].op == OpName.CREATE_JOB
        gets = recording.requests[1:]
        assert {r.op for r in gets} == {OpName.GET_JOB}, recording.requests
        assert len({r.job_id for r in gets}) == len(gets)
        assert all(r.body["wait_s"] > 1.5 for r in gets)
        assert client.generate([[1, 2]], {"max_tokens": 2})[0]["token_ids"]
    finally:
        client.close()
    assert recording.requests[-1].op == OpName.CANCEL_JOB
    assert service.get_job(client.sampling_job_id)["status"] == "cancelled"


@pytest.mark.parametrize("wait_s", ["-1", "1e9", "soon"])
def test_the_routes_refuse_a_bad_wait_s_naming_it(gated, wait_s):
    service, url, gate = gated
    gate.set()
    job_id = service.create_job(
        {"sub_job_configs": [{"job_type": "sampling", "model_name": TINY}]}
    )["job_id"]
    for path in (f"/job/{job_id}:sampling:0", f"{CORTEX}/{job_id}"):
        reply = httpx.get(url + path, params={"wait_s": wait_s}, timeout=30)
        assert reply.status_code == 400, reply.text
        assert reply.json()["field"] == "wait_s" and reply.json()["code"] == "invalid_argument"
    service.cancel_job(job_id)


class Scripted(Transport):
    """A stand-in backend whose job answers are the test's: ``status`` for every get-job."""

    def __init__(self, status: str, reason: str | None = None) -> None:
        self.status, self.reason = status, reason
        self.requests: list[Request] = []
        self.closed = 0

    def call(self, request: Request) -> Any:
        self.requests.append(request)
        sub = {"sub_job_id": "j1:training:0", "job_type": "training"}
        if request.op == OpName.CREATE_JOB:
            return {"job_ids": ["j1"], "sub_jobs": [sub]}
        if request.op == OpName.GET_JOB:
            return {"job_id": "j1", "status": self.status, "reason": self.reason, "sub_jobs": [sub]}
        if request.op == OpName.CANCEL_JOB:
            return None
        raise AssertionError(request.op)

    def close(self) -> None:
        self.closed += 1

    def ops(self) -> list[str]:
        return [request.op for request in self.requests]


def config(**extra) -> dict:
    backend = {"type": "http", "url": "http://127.0.0.1:1", "job_ready_timeout": 0.5}
    return {"model": TINY, "backend": backend, "training": {}, **extra}


def test_a_job_that_never_runs_times_out_and_is_cancelled():
    transport = Scripted("initializing")
    with pytest.raises(RequestTimeoutError, match="j1 is still initializing after"):
        SyncArcticRLClient(config(), transport=transport)
    assert transport.ops()[0] == OpName.CREATE_JOB
    assert transport.ops()[-1] == OpName.CANCEL_JOB and transport.requests[-1].job_id == "j1"
    assert transport.closed == 1


def test_a_job_that_fails_to_start_is_a_conflict_naming_the_reason():
    transport = Scripted("failed", reason="training_config.n_gpus: the job needs 4 CPU")
    with pytest.raises(ConflictError, match="job j1 is failed: training_config.n_gpus") as err:
        SyncArcticRLClient(config(), transport=transport)
    assert (err.value.status, err.value.code) == (409, "job_failed")
    assert transport.ops() == [OpName.CREATE_JOB, OpName.GET_JOB, OpName.CANCEL_JOB]


def test_attaching_never_creates_or_cancels():
    transport = Scripted("running")
    client = SyncArcticRLClient(config(training_job_id="j1:training:0"), transport=transport)
    assert client.training_job_id == "j1:training:0"
    client.close()
    assert transport.ops() == [OpName.GET_JOB] and transport.closed == 1


def test_attaching_to_a_sub_job_its_job_does_not_hold_is_not_found():
    transport = Scripted("running")
    with pytest.raises(NotFoundError, match="'j1:training:7' is not in job j1"):
        SyncArcticRLClient(config(training_job_id="j1:training:7"), transport=transport)
    assert transport.ops() == [OpName.GET_JOB] and transport.closed == 1


def test_closing_cancels_each_created_job_once():
    transport = Scripted("running")
    client = SyncArcticRLClient(config(), transport=transport)
    client.close()
    client.close()
    assert transport.ops() == [OpName.CREATE_JOB, OpName.GET_JOB, OpName.CANCEL_JOB]
    assert transport.closed == 1
