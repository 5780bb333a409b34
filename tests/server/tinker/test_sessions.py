"""Sessions whose client stopped heartbeating are finished and their jobs freed; a tenant has at
most ``--max-tinker-sessions-per-tenant`` open at once, and finished ones leave memory."""

from __future__ import annotations

from contextlib import closing

import httpx
import pytest
from typer.testing import CliRunner

from arctic_platform import cli
from arctic_platform.server.app import create_app
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.service import Service, ServiceSettings
from arctic_platform.server.store import MetadataStore
from arctic_platform.server.tinker.session_reaper import SessionReaper
from arctic_platform.server.tinker.state import TinkerState
from tests.live_server import serve_app, serve_process
from tests.server.tinker.conftest import ALICE, BOB, TINY
from tests.waiting import wait_until


def test_a_silent_session_is_finished_and_its_jobs_cancelled(tmp_path):
    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu"))
    app = create_app(service, tinker_session_timeout_s=1.0)
    with (
        serve_app(app) as url,
        httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": "tml-a"}) as http,
    ):
        silent, live = (http.post("/create_session", json={}).json()["session_id"] for _ in "ab")
        model = {"model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 4}}
        for session in (silent, live):
            assert http.post("/create_model", json={"session_id": session, **model}).is_success
        runs = app.state.tinker.state.runs
        silent_job, live_job = (runs[f"{s}:train:0"].job_id for s in (silent, live))

        def silent_one_finished() -> bool:
            assert http.post("/session_heartbeat", json={"session_id": live}).status_code == 200
            return service.get_job(silent_job)["status"] == "cancelled"

        wait_until(
            silent_one_finished,
            what="the silent session finished",
            timeout_s=60,
            interval_s=0.1,
        )
        assert http.post("/session_heartbeat", json={"session_id": silent}).status_code == 410
        assert http.post("/session_heartbeat", json={"session_id": live}).status_code == 200
        assert service.get_job(live_job)["status"] != "cancelled"


def test_the_reaper_finishes_only_sessions_past_the_timeout(tmp_path):
    state, finished = TinkerState(MetadataStore(tmp_path / "metadata.sqlite3")), []
    reaper = SessionReaper(state, lambda sid, owner: finished.append(sid), timeout_s=30)
    old, fresh = (state.new_session("o", ServerLimits()) for _ in range(2))
    old.last_heartbeat = fresh.last_heartbeat - 31
    assert reaper.reap(now=fresh.last_heartbeat) == [old.session_id]
    assert finished == [old.session_id]
    with pytest.raises(ValueError, match="session timeout"):
        SessionReaper(state, lambda *_: None, timeout_s=0)


def test_serve_flag_sets_the_session_timeout(tmp_path):
    """``serve --tinker-session-timeout 1``: a session without heartbeats is finished within
    seconds (the default is minutes); a finished session refuses new models with 410."""
    with (
        serve_process(tmp_path, "--tinker-session-timeout", "1") as (_, url),
        httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": "tml-a"}) as http,
    ):
        session = http.post("/create_session", json={}).json()["session_id"]
        # an optimizer we refuse: 400 while the session lives, 410 once it was finished
        body = {"session_id": session, "model_seq_id": 0, "base_model": TINY}
        body["optimizer_config"] = {"type": "sgd"}

        def finished() -> httpx.Response | None:
            answer = http.post("/create_model", json=body)
            if answer.status_code != 400:
                return answer
            assert "optimizer_config.type" in answer.json()["message"]
            return None

        answer = wait_until(
            finished, what="the silent session was never finished", timeout_s=60, interval_s=0.1
        )
        assert answer.status_code == 410


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_serve_refuses_a_bad_session_timeout_naming_the_flag(value):
    result = CliRunner().invoke(cli.app, ["serve", "--tinker-session-timeout", value])
    assert result.exit_code == 2
    assert "--tinker-session-timeout" in result.output


def test_a_session_lost_in_a_restart_is_gone_not_unknown(tmp_path):
    """The server restarts (a new Service on the same data dir): the SDK's heartbeat of a session
    from before gets 410, as for a finished session, so the client stops; an id the server never
    issued, or another tenant's, stays 404."""

    def app():
        service = Service(ServiceSettings(data_dir=tmp_path, device="cpu"))
        return create_app(service, auth=TokenAuth(["tml-a", "tml-b"]))

    def client(url: str, key: str) -> httpx.Client:
        return httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": key})

    with serve_app(app()) as url, client(url, "tml-a") as http:
        session = http.post("/create_session", json={}).json()["session_id"]
        assert http.post("/session_heartbeat", json={"session_id": session}).status_code == 200
    with serve_app(app()) as url, client(url, "tml-a") as http, client(url, "tml-b") as other:
        beat = http.post("/session_heartbeat", json={"session_id": session})
        assert beat.status_code == 410, beat.text
        assert beat.json()["code"] == "session_finished"
        assert http.post(f"/sessions/{session}/finish", json={}).status_code == 204
        assert other.post("/session_heartbeat", json={"session_id": session}).status_code == 404
        never = http.post("/session_heartbeat", json={"session_id": "0" * 32})
        assert never.status_code == 404


def test_a_tenants_open_sessions_are_bounded_and_finished_ones_leave_memory(tmp_path):
    """Two open sessions at most: a third is a 429 naming the limit, another tenant is not held
    back, and finishing one makes room. A finished session is no longer held in memory, yet it
    still answers 410 (from its record), so opening and finishing sessions in a loop does not
    grow the server."""
    limits = ServerLimits(max_tinker_sessions_per_tenant=2)
    service = Service(ServiceSettings(data_dir=tmp_path / "data", device="cpu", limits=limits))
    app = create_app(service, auth=TokenAuth([ALICE, BOB]))
    state = app.state.tinker.state
    try:
        with serve_app(app) as url, httpx.Client(base_url=f"{url}/api/v1", timeout=60) as http:

            def create(key: str) -> httpx.Response:
                return http.post("/create_session", json={}, headers={"X-API-Key": key})

            def finish(session_id: str) -> int:
                route = f"/sessions/{session_id}/finish"
                return http.post(route, json={}, headers={"X-API-Key": ALICE}).status_code

            first, _ = (create(ALICE).json()["session_id"] for _ in range(2))
            refused = create(ALICE)
            assert refused.status_code == 429, refused.text
            body = refused.json()
            assert body["code"] == "limit_exceeded"
            assert body["limit"] == "max_tinker_sessions_per_tenant" and body["maximum"] == 2
            assert "--max-tinker-sessions-per-tenant" in body["message"]
            assert create(BOB).status_code == 200

            assert finish(first) == 204
            assert first not in state.sessions
            beat = http.post(
                "/session_heartbeat", json={"session_id": first}, headers={"X-API-Key": ALICE}
            )
            assert beat.status_code == 410, beat.text
            assert finish(first) == 204  # finishing again is still fine
            for _ in range(20):
                assert finish(create(ALICE).json()["session_id"]) == 204
            assert len(state.sessions) == 2  # Alice's open one and Bob's
    finally:
        service.close()


def test_a_model_id_taken_is_a_409_that_leaves_no_job_behind(tmp_path):
    """``create_model`` (and ``load_weights`` into a new run) of a ``model_seq_id`` the session
    has already used is a 409, made before any job: each such refusal left a job running with
    its engines loaded, until the tenant's job limit refused its next real run."""
    from tests.server.tinker.plain_http import TinkerHttp

    service = Service(ServiceSettings(data_dir=tmp_path / "data", device="cpu"))
    app = create_app(service, auth=TokenAuth([ALICE]))
    alice = app.state.auth.owner(f"Bearer {ALICE}")
    try:
        with serve_app(app) as url, closing(TinkerHttp(url, ALICE)) as tinker:
            session = tinker.session()
            model_id = tinker.training_run(session, TINY)
            tinker.ok(tinker.save("save_weights", model_id, "w").json()["request_id"])
            again = {"session_id": session, "model_seq_id": 0, "base_model": TINY}
            path = f"tinker://{model_id}/weights/w"
            load = {"session_id": session, "model_seq_id": 0, "path": path, "optimizer": False}
            for route, body in [("create_model", again)] * 3 + [("load_weights", load)] * 2:
                refused = tinker.post(route, body)
                assert refused.status_code == 409, refused.text
                assert "already exists" in refused.json()["message"]
            live = [j for j in service.list_jobs(owner=alice) if j["status"] != "cancelled"]
            assert len(live) == 1
    finally:
        service.close()


def test_finishing_a_session_leaves_a_sampling_job_another_session_uses(tmp_path):
    """Samplers of one tenant on one model share a job: the session that started it finishing
    cancelled it under the other session's samples (which failed 'job was cancelled'). It stays
    while another live session uses it or a sample runs on it, and goes with the last."""
    from tests.fake_engine import build_fake_engine
    from tests.server.tinker.plain_http import TinkerHttp

    service = Service(
        ServiceSettings(data_dir=tmp_path / "data", device="cpu"), engine_builder=build_fake_engine
    )
    app = create_app(service, auth=TokenAuth([ALICE]))
    alice = app.state.auth.owner(f"Bearer {ALICE}")
    model_jobs = app.state.tinker.model_jobs
    try:
        with serve_app(app) as url, closing(TinkerHttp(url, ALICE)) as tinker:
            first, second, third = (tinker.session() for _ in range(3))
            for session in (first, second):
                created = tinker.post(
                    "create_sampling_session",
                    {"session_id": session, "sampling_session_seq_id": 0, "base_model": TINY},
                )
                assert created.status_code == 200, created.text
            (job,) = model_jobs.jobs(alice).values()

            assert tinker.post(f"sessions/{first}/finish", {}).status_code == 204
            assert service.get_job(job, owner=alice)["status"] != "cancelled"
            assert model_jobs.jobs(alice) == {TINY: job}  # the second session's, still
            # A sample in flight on it keeps it too, when its last session finishes.
            sub_job = model_jobs.begin(app.state.tinker.state.session(third, alice), alice, TINY)
            assert tinker.post(f"sessions/{second}/finish", {}).status_code == 204
            assert service.get_job(job, owner=alice)["status"] != "cancelled"
            model_jobs.end(alice, TINY, sub_job)
            assert tinker.post(f"sessions/{third}/finish", {}).status_code == 204
            assert service.get_job(job, owner=alice)["status"] == "cancelled"
    finally:
        service.close()
