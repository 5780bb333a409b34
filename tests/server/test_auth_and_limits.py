"""Tokens, tenant isolation, and request-size limits."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from arctic_platform import wire
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.errors import Unauthorized
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, OCTET, job_request, make_app

ALICE, BOB = "alice-token", "bob-token"


@pytest.fixture
def service(fake_service):
    """These tests are about the server's edges, not its engines: their jobs run on FakeEngine."""
    return fake_service


def bearer(token: str) -> dict:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def secured(service):
    with (
        serve_app(make_app(service, tokens=[ALICE, BOB])) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        yield client


def test_every_route_but_health_needs_a_token(secured):
    assert secured.get("/health").status_code == 200
    for method, path in [
        ("get", "/status"),
        ("get", CORTEX),
        ("post", "/step?job_id=x"),
        ("get", f"{CORTEX}/capacity"),
        ("post", "/initialize"),
    ]:
        response = getattr(secured, method)(path)
        assert response.status_code == 401, path
        assert response.json()["code"] == "unauthenticated"
    assert secured.get(CORTEX, headers=bearer("wrong")).status_code == 401
    assert secured.get(CORTEX, headers={"authorization": "Basic abc"}).status_code == 401
    pat = {**bearer(ALICE), "x-snowflake-authorization-token-type": "PROGRAMMATIC_ACCESS_TOKEN"}
    assert secured.get(CORTEX, headers=pat).status_code == 200
    oauth = {**bearer(ALICE), "x-snowflake-authorization-token-type": "OAUTH"}
    assert secured.get(CORTEX, headers=oauth).status_code == 401


def test_jobs_belong_to_the_token_that_created_them(secured):
    job_id = secured.post(CORTEX, json=job_request("training"), headers=bearer(ALICE)).json()[
        "job_id"
    ]
    assert secured.get(f"{CORTEX}/{job_id}", headers=bearer(ALICE)).status_code == 200
    assert secured.get(f"{CORTEX}/{job_id}", headers=bearer(BOB)).status_code == 404
    assert secured.post(f"{CORTEX}/{job_id}:cancel", headers=bearer(BOB)).status_code == 404
    assert (
        secured.post(f"/step?job_id={job_id}:training:0", json={}, headers=bearer(BOB)).status_code
        == 404
    )
    assert secured.get(CORTEX, headers=bearer(BOB)).json()["jobs"] == []
    assert [j["job_id"] for j in secured.get(CORTEX, headers=bearer(ALICE)).json()["jobs"]] == [
        job_id
    ]
    assert secured.get(f"{CORTEX}/{job_id}", headers=bearer(ALICE)).json()["status"] != "cancelled"


def test_tokens_are_compared_whole_and_never_kept():
    auth = TokenAuth(["secret-1", "secret-2"])
    assert auth.owner("Bearer secret-1") != auth.owner("Bearer secret-2")
    for header in ("Bearer secret", "Bearer secret-10", "bearer", None):
        with pytest.raises(Unauthorized):
            auth.owner(header)
    assert "secret-1" not in repr(vars(auth)).replace("b'secret-1'", "")  # only bytes for compare
    assert TokenAuth([]).owner(None) is None


def test_token_env_must_be_set(monkeypatch):
    monkeypatch.delenv("ARCTIC_TEST_TOKEN", raising=False)
    with pytest.raises(ValueError, match="ARCTIC_TEST_TOKEN"):
        TokenAuth.from_env("ARCTIC_TEST_TOKEN")
    monkeypatch.setenv("ARCTIC_TEST_TOKEN", "a, b")
    assert TokenAuth.from_env("ARCTIC_TEST_TOKEN").owner("Bearer b")


@pytest.mark.parametrize("value", [" , ", ",", " ", ",,\t,"])
def test_a_token_env_of_only_separators_is_refused(monkeypatch, value, tmp_path):
    from arctic_platform.server.serve import serve

    monkeypatch.setenv("ARCTIC_TEST_TOKEN", value)
    with pytest.raises(ValueError, match="ARCTIC_TEST_TOKEN"):
        TokenAuth.from_env("ARCTIC_TEST_TOKEN")
    with pytest.raises(SystemExit, match="ARCTIC_TEST_TOKEN"):  # before anything listens
        serve(
            host="127.0.0.1",
            port=1,
            token_env="ARCTIC_TEST_TOKEN",
            data_dir=tmp_path,
            device="cpu",
            max_body_mb=1,
            max_concurrent_ops=1,
        )
    assert not any(tmp_path.iterdir())


def test_an_unset_scrape_token_variable_stops_serve_naming_its_flag(monkeypatch, tmp_path):
    from arctic_platform.server.serve import serve

    monkeypatch.delenv("ARCTIC_TEST_SCRAPE", raising=False)
    with pytest.raises(SystemExit, match="--metrics-token-env ARCTIC_TEST_SCRAPE"):
        serve(
            host="127.0.0.1",
            port=1,
            token_env=None,
            metrics_token_env="ARCTIC_TEST_SCRAPE",
            data_dir=tmp_path,
            device="cpu",
            max_body_mb=1,
            max_concurrent_ops=1,
        )
    assert not any(tmp_path.iterdir())


def test_bodies_above_the_limit_are_refused_with_413(service):
    with (
        serve_app(make_app(service, max_body_bytes=4096)) as url,
        httpx.Client(base_url=url) as http,
    ):
        job_id = service.create_job(job_request("training"))["job_id"]
        big = wire.dumps({"batch": {"x": np.zeros(4096, np.uint8)}})
        for path in (f"/forward-backward?job_id={job_id}", f"{CORTEX}/{job_id}/forward-backward"):
            response = http.post(path, content=big, headers=OCTET)
            assert response.status_code == 413 and "4096-byte limit" in response.json()["message"]

        def stream():  # no Content-Length: counted while reading
            for _ in range(10):
                yield b"\x00" * 1000

        response = http.post("/forward-backward?job_id=x", content=stream(), headers=OCTET)
        assert response.status_code == 413
        assert http.get("/health").status_code == 200
