"""`arctic-platform serve` as users run it: a subprocess on a free loopback port."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from arctic_platform import wire
from tests.live_server import serve_process, stopped
from tests.server.conftest import CORTEX, OCTET, TINY, job_request
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def wait_request(http, job_id, request_id):
    def done() -> dict | None:
        body = http.get(f"{CORTEX}/{job_id}/requests/{request_id}").json()
        if body["status"] == "done":
            return body
        assert body["status"] in ("pending", "running"), body
        return None

    return wait_until(done, what=f"request {request_id} done", interval_s=0.05)["result"]


def onprem_steps(url: str, steps: int, results: list) -> None:
    with httpx.Client(base_url=url, timeout=120) as http:
        job = http.post(
            "/initialize",
            json={
                "model_name": TINY,
                "job_type": "training",
                "training_config": {"optimizer": {"lr": 1e-3}},
            },
        ).json()
        ids = [[1, 10, 11, 12, 13], [1, 14, 15, 16, 17]]
        batch = {"input_ids": ids, "attention_mask": [[1] * 5] * 2, "labels": ids}
        import numpy as np

        frame = wire.dumps(
            {
                "batch": {k: np.array(v) for k, v in batch.items()},
                "processing": {"loss_fn": "cross_entropy"},
            }
        )
        losses = []
        for _ in range(steps):
            out = http.post(
                f"/forward-backward?job_id={job['job_id']}", content=frame, headers=OCTET
            )
            losses.append(wire.loads(out.content)["loss"])
            http.post(f"/step?job_id={job['job_id']}", json={})
        results.append(losses)


def test_two_clients_on_two_jobs_at_once_then_restart(tmp_path):
    with serve_process(tmp_path) as (_, url):
        results: list = []
        threads = [threading.Thread(target=onprem_steps, args=(url, 5, results)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 2
        assert results[0] == results[1]  # same model, same seed, same batch: same losses
        assert results[0][-1] < results[0][0]  # and training works
        with httpx.Client(base_url=url, timeout=120) as http:
            job_id = http.post(CORTEX, json=job_request("training")).json()["job_id"]
            wait_until(
                lambda: http.get(f"{CORTEX}/{job_id}").json()["status"] == "running",
                what="the job running",
            )
            saved = wait_request(
                http, job_id, http.post(f"{CORTEX}/{job_id}/save", json={}).json()["request_id"]
            )
    with serve_process(tmp_path) as (_, url), httpx.Client(base_url=url, timeout=120) as http:
        assert http.get(f"{CORTEX}/{job_id}").json()["status"] == "terminated"
        listed = http.get(f"{CORTEX}/{job_id}/checkpoints").json()["checkpoints"]
        assert [c["checkpoint_id"] for c in listed] == [saved["checkpoint_id"]]
        spec = job_request("training")["sub_job_configs"][0]
        spec["source_checkpoint_info"] = {
            "checkpoint_id": saved["checkpoint_id"],
            "source_job_id": job_id,
        }
        new_id = http.post(CORTEX, json={"sub_job_configs": [spec]}).json()["job_id"]

        def resumed() -> bool:
            job = http.get(f"{CORTEX}/{new_id}").json()
            assert job["status"] in ("pending", "initializing", "running"), job
            return job["status"] == "running"

        wait_until(resumed, what="the job started from the checkpoint running")


def test_sigterm_finishes_the_op_in_flight_then_exits(tmp_path):
    with (
        serve_process(tmp_path, "--drain-timeout", "600") as (process, url),
        httpx.Client(base_url=url, timeout=120) as http,
    ):
        job = http.post("/initialize", json={"model_name": TINY, "job_type": "sampling"}).json()
        body = wire.dumps(
            {
                "prompts": ["1+1="] * 2,
                "sampling_params": {"n": 8, "max_tokens": 100, "min_tokens": 100, "seed": 3},
            }
        )
        outcome = {}

        def generate():
            outcome["response"] = http.post(
                f"/generate?job_id={job['job_id']}", content=body, headers=OCTET
            )

        thread = threading.Thread(target=generate)
        thread.start()
        wait_until(  # until the op is running
            lambda: http.get("/status").json()["running_ops"] != 0,
            what="the generate op never started",
            interval_s=0.01,
        )
        process.send_signal(signal.SIGTERM)
        thread.join(timeout=120)
        assert process.wait(timeout=60) == 0
        response = outcome["response"]
        assert response.status_code == 200
        results = wire.loads(response.content)["results"]
        assert len(results) == 16 and all(len(r["token_ids"]) == 100 for r in results)


def test_refuses_to_listen_beyond_loopback_without_a_token(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "arctic_platform.cli",
            "serve",
            "--host",
            "0.0.0.0",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "without authentication" in result.stderr + result.stdout


def test_token_protected_server(tmp_path):
    env = {"ARCTIC_TEST_SERVE_TOKEN": "s3cret"}
    with serve_process(tmp_path, "--token-env", "ARCTIC_TEST_SERVE_TOKEN", env=env) as (
        _process,
        url,
    ):
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/status").status_code == 401
        assert (
            httpx.get(f"{url}/status", headers={"authorization": "Bearer s3cret"}).status_code
            == 200
        )


def test_sigterm_with_a_long_generate_in_flight_exits_after_the_drain_timeout(tmp_path):
    with serve_process(tmp_path / "data", "--drain-timeout", "1") as (process, url):
        http = httpx.Client(base_url=url, timeout=600)
        job = http.post(CORTEX, json=job_request("sampling")).json()["job_id"]
        deadline = time.monotonic() + 120  # one bound for the job and its request
        wait_until(
            lambda: http.get(f"{CORTEX}/{job}").json()["status"] == "running",
            what=f"job {job} running",
            interval_s=0.05,
        )
        endless = {"n": 2048, "max_tokens": 1000, "ignore_eos": True}
        request = http.post(
            f"{CORTEX}/{job}/generate",
            content=wire.dumps({"prompts": ["1+2="], "sampling_params": endless}),
            headers=OCTET,
        ).json()["request_id"]
        wait_until(
            lambda: http.get(f"{CORTEX}/{job}/requests/{request}").json()["status"] == "running",
            what=f"request {request} running",
            timeout_s=deadline - time.monotonic(),
            interval_s=0.05,
        )
        process.send_signal(signal.SIGTERM)
        # Without the drain bound the server would wait for the whole generation (minutes).
        assert process.wait(timeout=120) == 0
        http.close()


@pytest.mark.parametrize(
    ("backend", "probe"),
    [
        ({"type": "http"}, "/health"),
        (
            {"type": "cortex", "database": "DB", "schema": "RL", "poll_max_interval": 0.2},
            "/capacity",
        ),
    ],
)
def test_a_stopped_server_is_reported_while_an_op_waits_on_it(tmp_path, backend, probe):
    from arctic_platform.client import (
        ServerUnresponsiveError,  # as README names it
        SyncArcticRLClient,
    )
    from arctic_platform.client.config import load_config

    with serve_process(tmp_path / "data") as (process, url):
        address = {"url": url} if backend["type"] == "http" else {"base_url": url}
        section = {**backend, **address, "liveness_timeout": 2}
        config = load_config({"model": TINY, "seed": 0, "backend": section, "sampling": {}})
        with SyncArcticRLClient(config) as client:
            errors: list[BaseException] = []

            def generate() -> None:
                endless = {"n": 2048, "max_tokens": 1000, "ignore_eos": True}
                try:
                    client.generate(["1+2="], endless)
                except Exception as exc:
                    errors.append(exc)

            waiting = threading.Thread(target=generate)
            waiting.start()
            with stopped(process):
                # Without the watch the client waits its request timeout (1800 s on http; 300 s
                # per poll, retried, on cortex).
                waiting.join(timeout=120)
                assert not waiting.is_alive(), "the client kept waiting on a stopped server"
            assert len(errors) == 1 and isinstance(errors[0], ServerUnresponsiveError), errors
            assert f"has not answered {probe} for 2s" in str(errors[0])
