"""Tinker work waiting for a job's engines to load holds no thread: one tenant's waits on a model
still loading do not hold up another tenant's ``create_model`` (they shared eight threads, so a
dozen samples on a loading model stalled every tenant for as long as it loaded)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from contextlib import closing

import pytest

from arctic_platform.server.app import create_app
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.errors import Conflict
from arctic_platform.server.service import Service, ServiceSettings
from arctic_platform.server.tinker.job_starts import JobStarts
from tests.fake_engine import build_fake_engine
from tests.live_server import serve_app
from tests.server.conftest import job_request
from tests.server.tinker.conftest import ALICE, BOB, TINY
from tests.server.tinker.plain_http import TinkerHttp
from tests.waiting import wait_until


def test_one_tenants_waits_on_a_loading_model_do_not_hold_up_another_tenant(tmp_path):
    gate = threading.Event()  # Alice's jobs load until the test opens it

    def builder(service, sub, source):
        if service.jobs.get(sub.job_id, None, check_owner=False).owner == alice:
            gate.wait(timeout=120)
        return build_fake_engine(service, sub, source)

    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu"), engine_builder=builder)
    app = create_app(service, auth=TokenAuth([ALICE, BOB]))
    alice = app.state.auth.owner(f"Bearer {ALICE}")
    try:
        with (
            serve_app(app) as url,
            closing(TinkerHttp(url, ALICE)) as a,
            closing(TinkerHttp(url, BOB)) as b,
        ):
            session = a.session()
            sampler = a.post(
                "create_sampling_session",
                {"session_id": session, "sampling_session_seq_id": 0, "base_model": TINY},
            ).json()["sampling_session_id"]
            sample = {
                "sampling_session_id": sampler,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
                "sampling_params": {"max_tokens": 2, "temperature": 0.0},
            }
            threads = _threads()
            waiting = [a.submit("asample", sample) for _ in range(12)]
            model = {"session_id": session, "base_model": TINY, "lora_config": {"rank": 4}}
            waiting += [a.submit("create_model", {**model, "model_seq_id": i}) for i in range(3)]
            assert _threads() <= threads + 1  # the watcher; no thread per wait

            bobs = b.training_run(b.session(), TINY)  # answered while Alice's waits go on
            assert bobs.endswith(":train:0")
            gate.set()
            for request_id in waiting:
                answer = a.result(request_id)
                assert answer.status_code == 200, answer.text
    finally:
        gate.set()
        service.close()


def _threads() -> int:
    """Threads alive, but those building jobs (one per job, whatever waits for it)."""
    return sum(not t.name.startswith("job-init-") for t in threading.enumerate())


def test_a_wait_ends_with_the_jobs_end_or_the_watcher_closing(tmp_path):
    """A job that ends while starting fails what waits for it with the job's reason, and
    closing the watcher cancels what still waits; neither calls what waited."""
    gate = threading.Event()

    def builder(service, sub, source):
        gate.wait(timeout=120)
        return build_fake_engine(service, sub, source)

    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu"), engine_builder=builder)
    starts = JobStarts(service, timeout_s=120)
    called: list[str] = []
    try:
        ending, closing_on = (service.create_job(job_request("training"))["job_id"] for _ in "ab")
        outcomes: list[Future] = [Future(), Future()]
        for job_id, outer in zip((ending, closing_on), outcomes, strict=True):
            starts.then(job_id, None, outer, lambda job=job_id: called.append(job))
        service.cancel_job(ending)
        with pytest.raises(Conflict, match="cancelled"):
            outcomes[0].result(timeout=60)
        starts.close()
        wait_until(outcomes[1].cancelled, what="the wait cancelled by close")
        assert called == []
    finally:
        gate.set()
        starts.close()
        service.close()
