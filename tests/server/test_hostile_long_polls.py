"""Long polls from one tenant are bounded, against the real server over 127.0.0.1.

A get-job with ``?wait_s=`` (on-prem and Cortex routes) and Tinker's ``retrieve_future`` hold
their answer, and a connection, while they wait. A tenant has at most
``--max-long-polls-per-tenant`` of them waiting at once: one more get-job is answered at once (as
by a server without long polls), one more ``retrieve_future`` gets 429 ``limit_exceeded`` naming
the limit and its flag, and the SDK is told to keep at most half the limit in sample requests.
Another tenant, a poll that need not wait, and the same tenant once one of its polls has
answered are not held back. Jobs stay starting because their engine builds wait on a gate; the
Tinker polls wait on op futures the test finishes itself (the subject is the poll, not the op).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import httpx

from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.service import Service, ServiceSettings
from arctic_platform.server.tinker.futures import OpResult
from tests.fake_engine import build_fake_engine, gated_builder
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, job_request, make_app
from tests.server.test_hostile_uploads import ALICE, BOB, credentials
from tests.waiting import wait_until

WAIT_S = 60  # get-job's longest wait: a poll that waited it out would time out the client
CLIENT_TIMEOUT_S = 30


def _get(url: str, path: str, token: str, wait_s: float = 0) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
        return http.get(path, params={"wait_s": wait_s}, headers=credentials(token))


def _retrieve(url: str, request_id: str, token: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
        body = {"request_id": request_id}
        return http.post("/api/v1/retrieve_future", json=body, headers=credentials(token))


def test_a_tenant_has_at_most_max_long_polls_per_tenant_waiting(tmp_path):
    gate = threading.Event()

    limits = ServerLimits(max_long_polls_per_tenant=2)
    settings = ServiceSettings(data_dir=tmp_path / "data", device="cpu", limits=limits)
    service = Service(settings, engine_builder=gated_builder(build_fake_engine, gate))
    app = make_app(service, tokens=[ALICE, BOB])
    alice, bob = (app.state.auth.owner(f"Bearer {token}") for token in (ALICE, BOB))
    polls = app.state.long_polls
    try:
        with serve_app(app) as url, ThreadPoolExecutor(2) as pool:
            job = service.create_job(job_request("sampling"), owner=alice)["job_id"]
            bobs = service.create_job(job_request("sampling"), owner=bob)["job_id"]
            pending: Future = Future()
            request_id = app.state.tinker.futures.add(alice, pending)
            waiting = [
                pool.submit(_get, url, f"/job/{job}:sampling:0", ALICE, WAIT_S),
                pool.submit(_retrieve, url, request_id, ALICE),
            ]
            wait_until(lambda: polls.held(alice) == 2, what="Alice's two long polls waiting")

            # A third get-job is answered at once, the job still starting (had it waited its
            # 60 s, the client's 30 s timeout would have ended it).
            answer = _get(url, f"{CORTEX}/{job}", ALICE, WAIT_S)
            assert answer.json()["status"] == "initializing"
            # A third retrieve is refused, naming the limit.
            other = app.state.tinker.futures.add(alice, Future())
            refused = _retrieve(url, other, ALICE)
            assert refused.status_code == 429, refused.text
            body = refused.json()
            assert body["code"] == "limit_exceeded" and body["limit"] == "max_long_polls_per_tenant"
            assert body["maximum"] == 2 and "--max-long-polls-per-tenant" in body["message"]
            # Another tenant's long poll is its own.
            assert _get(url, f"{CORTEX}/{bobs}", BOB, 0.2).status_code == 200
            assert polls.held(alice) == 2

            pending.set_result(OpResult(json={"answered": True}))
            assert waiting[1].result(timeout=60).json() == {"answered": True}
            wait_until(lambda: polls.held(alice) == 1, what="the answered poll's slot back")
            assert _get(url, f"{CORTEX}/{job}", ALICE, 0.2).status_code == 200
            gate.set()
            assert waiting[0].result(timeout=60).status_code == 200
            assert polls.held(alice) == 0

            with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as http:
                config = http.post("/api/v1/client/config", json={}, headers=credentials(ALICE))
            assert config.json()["sample_max_concurrent_requests"] == 1  # half of 2
    finally:
        gate.set()
        service.close()
