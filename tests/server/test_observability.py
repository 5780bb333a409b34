"""What an operator sees: Prometheus metrics and structured access logs with request ids that the
client logs too."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from arctic_platform import wire
from arctic_platform.server.app import create_app
from arctic_platform.server.auth import TokenAuth
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, OCTET, job_request


@pytest.fixture
def service(fake_service):
    """These tests are about the server's edges, not its engines: their jobs run on FakeEngine."""
    return fake_service


def scrape(http) -> dict[tuple[str, tuple], float]:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_metrics_count_ops_tokens_queue_depth_and_jobs(http, service):
    job_id = service.create_job(job_request("sampling"))["job_id"]
    service.wait_until_running(job_id, timeout=120)
    body = {"prompts": ["1+2=", "3+4="], "sampling_params": {"n": 2, "max_tokens": 3}}
    answer = http.post(f"/generate?job_id={job_id}", content=wire.dumps(body), headers=OCTET)
    assert answer.status_code == 200
    generated = sum(len(r["token_ids"]) for r in wire.loads(answer.content)["results"])
    bad = http.post(f"/generate?job_id={job_id}", json={"prompts": []})
    assert bad.status_code == 400  # refused before it ran: not an op
    metrics = scrape(http)
    assert metrics[("arctic_ops_total", (("op", "generate"), ("status", "ok")))] == 1
    assert metrics[("arctic_op_seconds_count", (("op", "generate"),))] == 1
    assert metrics[("arctic_tokens_processed_total", (("op", "generate"),))] == generated
    assert metrics[("arctic_queue_depth", (("job_id", job_id),))] == 0
    assert metrics[("arctic_jobs", (("state", "running"),))] == 1
    service.cancel_job(job_id)
    assert scrape(http)[("arctic_jobs", (("state", "cancelled"),))] == 1


def test_every_response_has_a_request_id_and_one_access_log_line(http, caplog):
    caplog.set_level(logging.INFO, logger="arctic_platform.access")
    given = http.get("/health", headers={"x-request-id": "trace-123"})
    assert given.headers["x-request-id"] == "trace-123"
    missing = http.get(f"{CORTEX}/nope")
    assert missing.status_code == 404 and len(missing.headers["x-request-id"]) == 32
    hostile = http.get("/health", headers={"x-request-id": "a\tb" + "x" * 100})
    assert hostile.headers["x-request-id"] != "a\tb" + "x" * 100  # replaced, not echoed
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name.endswith("access")]
    by_id = {line["request_id"]: line for line in lines}
    assert by_id["trace-123"]["path"] == "/health" and by_id["trace-123"]["status"] == 200
    assert by_id[missing.headers["x-request-id"]]["status"] == 404
    assert all(line["duration_ms"] >= 0 and line["method"] == "GET" for line in lines)


@pytest.mark.parametrize("backend", ["http", "cortex"])
def test_the_client_logs_the_request_id_of_a_failed_request(http, service, caplog, backend):
    from arctic_platform.client.config import load_config
    from arctic_platform.client.errors import InvalidRequestError
    from arctic_platform.client.job_lifecycle import JobLifecycle
    from arctic_platform.client.transport import Request
    from arctic_platform.client.transports import make_transport

    url = str(http.base_url).rstrip("/")
    section = {"type": "http", "url": url}
    if backend == "cortex":
        section = {"type": "cortex", "base_url": url, "database": "DB", "schema": "RL"}
    config = load_config({"model": "builtin:tiny", "seed": 0, "backend": section, "sampling": {}})
    transport = make_transport(config)
    transport.open()
    lifecycle = JobLifecycle(transport, config)
    jobs = lifecycle.start()
    caplog.set_level(logging.WARNING, logger="arctic_platform.client")
    try:
        with pytest.raises(InvalidRequestError):
            transport.call(Request("log-probs", jobs.sampling, {"prompts": []}, binary=False))
    finally:
        lifecycle.stop()
        transport.close()
    logged = [r.getMessage() for r in caplog.records if "server request id" in r.getMessage()]
    assert logged and all("none" not in line for line in logged)


def test_metrics_show_a_tenant_its_own_jobs_and_the_scrape_token_every_job(service):
    app = create_app(
        service,
        auth=TokenAuth(["alice-token", "bob-token"]),
        metrics_auth=TokenAuth(["scrape-token"]),
        close_service_on_shutdown=False,
    )
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=60) as http:

        def bearer(token: str) -> dict:
            return {"authorization": f"Bearer {token}"}

        def create(token: str) -> str:
            answer = http.post(CORTEX, json=job_request("sampling"), headers=bearer(token))
            assert answer.status_code == 200, answer.text
            return answer.json()["job_id"]

        def jobs_seen(token: str) -> tuple[set, float]:
            http.headers.update(bearer(token))
            metrics = scrape(http)
            ids = {
                dict(labels)["job_id"] for name, labels in metrics if name == "arctic_queue_depth"
            }
            total = sum(v for (name, _), v in metrics.items() if name == "arctic_jobs")
            return ids, total

        alice, bob = create("alice-token"), create("bob-token")
        assert jobs_seen("alice-token") == ({alice}, 1)
        assert jobs_seen("bob-token") == ({bob}, 1)
        assert jobs_seen("scrape-token") == ({alice, bob}, 2)
        # The scrape token opens /metrics only; no token opens nothing.
        assert http.get(CORTEX, headers=bearer("scrape-token")).status_code == 401
        assert http.get("/metrics", headers={"authorization": ""}).status_code == 401
