"""OpenAI requests wait for their model on the event loop, not on a worker thread.

Every route that runs blocking work does so on AnyIO's worker threads (40 by default, shared by
all tenants). A completion that waits for its model's job to start, and then for its op, holds
none of them: more completions than there are threads wait at once, and a route that needs a
thread still answers meanwhile. Real server over 127.0.0.1, real ``builtin:tiny`` engines, whose
build waits on a gate so the requests are seen waiting.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.engines import build_engine
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.service import Service, ServiceSettings
from tests.fake_engine import gated_builder
from tests.live_server import serve_app
from tests.server.conftest import make_app
from tests.waiting import wait_until

ALICE, BOB = "tml-alice", "tml-bob"
BOB_OWNER = TokenAuth([BOB]).owner(f"Bearer {BOB}")
HEADERS = {"authorization": f"Bearer {ALICE}"}
WAITING = 45  # more than AnyIO's 40 worker threads
BODY = {"model": "builtin:tiny", "prompt": "1+2=", "max_tokens": 3, "seed": 7}


def _complete(url: str, headers: dict = HEADERS) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120) as http:
        return http.post("/v1/completions", json=BODY, headers=headers)


def test_completions_waiting_for_their_model_hold_no_worker_thread(tmp_path):
    gate = threading.Event()

    service = Service(
        ServiceSettings(data_dir=tmp_path / "data", device="cpu"),
        engine_builder=gated_builder(build_engine, gate),
    )
    app = make_app(service, tokens=[ALICE])
    jobs = app.state.tinker.model_jobs

    def waiting() -> int:  # requests counted on their model's job
        return sum(job.in_flight for job in jobs._jobs.values())

    try:
        with serve_app(app) as url, ThreadPoolExecutor(WAITING) as pool:
            requests = [pool.submit(_complete, url) for _ in range(WAITING)]
            wait_until(lambda: waiting() == WAITING, what="every completion waiting for its model")
            with httpx.Client(base_url=url, timeout=60) as http:
                listed = http.get("/v1/models", headers=HEADERS)  # runs on a worker thread
            assert listed.status_code == 200 and listed.json()["data"]
            gate.set()
            answers = [request.result(timeout=120) for request in requests]
            assert [a.status_code for a in answers] == [200] * WAITING
            texts = {a.json()["choices"][0]["text"] for a in answers}
            assert len(texts) == 1  # the same seeded request, answered alike
            assert waiting() == 0
    finally:
        gate.set()
        service.close()


def test_a_tenants_openai_requests_under_way_are_bounded(tmp_path):
    """Each waiting completion holds a connection: beyond ``--max-openai-requests-per-tenant``
    under way at once, one more is a 429 in OpenAI's shape, naming the limit; another tenant's
    is not held back."""
    gate = threading.Event()
    limits = ServerLimits(max_openai_requests_per_tenant=2)
    settings = ServiceSettings(data_dir=tmp_path / "data", device="cpu", limits=limits)
    service = Service(settings, engine_builder=gated_builder(build_engine, gate))
    app = make_app(service, tokens=[ALICE, BOB])
    alice = app.state.auth.owner(HEADERS["authorization"])
    under_way = app.state.openai_requests
    try:
        with serve_app(app) as url, ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(_complete, url) for _ in range(2)]
            wait_until(lambda: under_way.held(alice) == 2, what="two completions waiting")
            refused = _complete(url)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert error["param"] == "max_openai_requests_per_tenant"
            assert "--max-openai-requests-per-tenant" in error["message"]
            bobs = pool.submit(_complete, url, {"authorization": f"Bearer {BOB}"})
            wait_until(lambda: under_way.held(BOB_OWNER) == 1, what="Bob's waiting")
            gate.set()
            answers = [request.result(timeout=120) for request in [*waiting, bobs]]
            assert [a.status_code for a in answers] == [200] * 3
            assert under_way.held(alice) == 0
    finally:
        gate.set()
        service.close()
