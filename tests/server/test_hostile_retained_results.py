"""Finished results kept for polling are bounded in bytes, and one tenant's results cannot push
another's out, against the real server over 127.0.0.1 (Cortex routes, fake engines: the subject is
the store, not the engine).

The Cortex and Tinker APIs keep a finished op's result until the client fetches it (and for a
while after, in case the answer is lost). They were bounded by count alone, across all tenants:
4,096 large results nobody fetched could fill the server's memory, and a tenant's 4,096 quick ops
dropped every other tenant's unfetched results. With ``--max-retained-results-mb`` (1 MiB here)
the job holding the most drops its oldest.
"""

from __future__ import annotations

import httpx
import numpy as np

from arctic_platform import wire
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.service import Service, ServiceSettings
from tests.fake_engine import build_fake_engine
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, OCTET, job_request, make_app
from tests.server.test_hostile_uploads import ALICE, BOB, credentials
from tests.waiting import wait_until


def _forward(rows: int) -> bytes:
    """A forward of ``rows`` x 256 tokens: its log-probs hold ``rows`` KiB."""
    ids = np.full((rows, 256), 5, np.int64)
    return wire.dumps({"batch": {"input_ids": ids, "attention_mask": np.ones_like(ids)}})


def test_one_jobs_unfetched_results_drop_its_own_oldest_not_another_jobs(tmp_path):
    limits = ServerLimits(max_retained_results_mb=1)
    settings = ServiceSettings(data_dir=tmp_path / "data", device="cpu", limits=limits)
    service = Service(settings, engine_builder=build_fake_engine)
    app = make_app(service, tokens=[ALICE, BOB])
    try:
        with serve_app(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            jobs = {}
            for token in (ALICE, BOB):
                owner = app.state.auth.owner(f"Bearer {token}")
                jobs[token] = service.create_job(job_request("training"), owner=owner)["job_id"]
                service.wait_until_running(jobs[token], owner=owner, timeout=60)

            def forward(token: str, rows: int) -> str:
                headers = {**OCTET, **credentials(token)}
                route = f"{CORTEX}/{jobs[token]}/forward-no-grad"
                answer = http.post(route, content=_forward(rows), headers=headers)
                assert answer.status_code == 200, answer.text
                return answer.json()["request_id"]

            def poll(token: str, request_id: str) -> httpx.Response:
                route = f"{CORTEX}/{jobs[token]}/requests/{request_id}"
                return http.get(route, headers=credentials(token))

            def done(token: str, request_id: str) -> bool:
                return poll(token, request_id).json()["status"] == "done"

            bobs = forward(BOB, 8)  # 8 KiB of log-probs, not fetched yet
            wait_until(lambda: done(BOB, bobs), what="Bob's forward done")
            alices = []
            for _ in range(3):  # 300 KiB each, 400 KB kept as base64: the third passes 1 MiB
                alices.append(forward(ALICE, 300))
                wait_until(lambda: done(ALICE, alices[-1]), what="Alice's forward done")

            assert poll(ALICE, alices[0]).status_code == 404  # her oldest made room
            for request_id in alices[1:]:
                assert poll(ALICE, request_id).json()["status"] == "done"
            kept = poll(BOB, bobs)
            assert kept.status_code == 200 and kept.json()["status"] == "done", kept.text
    finally:
        service.close()
