"""What one tenant may hold is bounded on every API that creates jobs (on-prem ``/initialize``,
Cortex create-job, Tinker training clients and samplers), and what the server tells a tenant
about its load is that tenant's own."""

from __future__ import annotations

import shutil
import threading

import httpx
import pytest
import torch

from arctic_platform import wire
from arctic_platform.engine.models import local_model_path
from arctic_platform.server.app import create_app
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.errors import Conflict
from arctic_platform.server.service import Service, ServiceSettings
from arctic_platform.server.tenant_quota import TenantQuota, weight_bytes
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, OCTET, TINY, job_request, sub_job

ALICE, BOB, SCRAPER = "tml-alice", "tml-bob", "scrape-token"


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def owner(token: str) -> str:
    return TokenAuth([token]).owner(f"Bearer {token}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two tenants, at most two live jobs each, an operator's scrape token."""
    data = tmp_path_factory.mktemp("data")
    service = Service(
        ServiceSettings(data_dir=data, device="cpu", quota=TenantQuota(max_jobs_per_tenant=2))
    )
    app = create_app(
        service,
        auth=TokenAuth([ALICE, BOB]),
        metrics_auth=TokenAuth([SCRAPER]),
        close_service_on_shutdown=False,
    )
    try:
        with serve_app(app) as url, httpx.Client(base_url=url, timeout=120) as http:
            yield service, http
    finally:
        service.close()


def refused_for_jobs(answer: httpx.Response) -> None:
    assert answer.status_code == 409, answer.text
    body = answer.json()
    assert body["code"] == "limit_exceeded" and body["limit"] == "max_jobs_per_tenant"
    assert body["value"] == 3 and body["maximum"] == 2
    assert "--max-jobs-per-tenant" in body["message"]


def test_a_tenants_live_jobs_are_capped_on_every_create_route(server):
    _, http = server
    first = http.post(CORTEX, json=job_request("training"), headers=bearer(ALICE))
    assert first.status_code == 200, first.text
    init = {"model_name": TINY, "job_type": "sampling", "seed": 0}
    assert http.post("/initialize", json=init, headers=bearer(ALICE)).status_code == 200
    before = {j["job_id"] for j in http.get(CORTEX, headers=bearer(ALICE)).json()["jobs"]}
    refused_for_jobs(http.post(CORTEX, json=job_request("sampling"), headers=bearer(ALICE)))
    refused_for_jobs(http.post("/initialize", json=init, headers=bearer(ALICE)))
    tinker = {"X-API-Key": ALICE}
    session = http.post("/api/v1/create_session", json={}, headers=tinker).json()["session_id"]
    model = {"session_id": session, "model_seq_id": 0, "base_model": TINY}
    refused_for_jobs(http.post("/api/v1/create_model", json=model, headers=tinker))
    sampler = {"session_id": session, "sampling_session_seq_id": 0, "base_model": TINY}
    refused_for_jobs(http.post("/api/v1/create_sampling_session", json=sampler, headers=tinker))
    # nothing was created by the refusals; another tenant is not held back by Alice's jobs
    after = {j["job_id"] for j in http.get(CORTEX, headers=bearer(ALICE)).json()["jobs"]}
    assert after == before
    assert http.post(CORTEX, json=job_request("sampling"), headers=bearer(BOB)).status_code == 200
    # an ended job no longer counts
    http.post(f"{CORTEX}/{first.json()['job_id']}:cancel", headers=bearer(ALICE))
    again = http.post(CORTEX, json=job_request("sampling"), headers=bearer(ALICE))
    assert again.status_code == 200, again.text


def test_capacity_and_status_show_the_callers_own_load(server):
    service, http = server
    for job in service.list_jobs(owner=owner(ALICE)):
        service.cancel_job(job["job_id"], owner=owner(ALICE))
    job_id = http.post(CORTEX, json=job_request("training"), headers=bearer(ALICE)).json()["job_id"]
    service.wait_until_running(job_id, owner=owner(ALICE), timeout=120)
    engine = service.resolve(job_id, owner=owner(ALICE), kind="training").engine
    inside, release = threading.Event(), threading.Event()

    def hold(*_):
        inside.set()
        assert release.wait(120)

    hook = engine.model.get_input_embeddings().register_forward_hook(hold)
    ids = torch.ones(1, 8, dtype=torch.long)
    frame = wire.dumps({"batch": {"input_ids": ids, "attention_mask": ids, "labels": ids}})
    answers: list[httpx.Response] = []

    def fwd_bwd() -> None:
        route = f"/forward-backward?job_id={job_id}"
        answers.append(http.post(route, content=frame, headers={**OCTET, **bearer(ALICE)}))
        inside.set()  # an op that did not run says why below

    op = threading.Thread(target=fwd_bwd)
    op.start()
    try:
        assert inside.wait(120) and not answers, answers and answers[0].text
        mine = http.get(f"{CORTEX}/capacity", headers=bearer(ALICE)).json()
        theirs = http.get(f"{CORTEX}/capacity", headers=bearer(BOB)).json()
        everyone = http.get(f"{CORTEX}/capacity", headers=bearer(SCRAPER)).json()
        bob_live = sum(
            len(j["sub_jobs"])
            for j in service.list_jobs(owner=owner(BOB))
            if j["status"] not in ("failed", "cancelled", "terminated")
        )
        assert (mine["active_sub_jobs"], mine["running_ops"]) == (1, 1)
        assert (theirs["active_sub_jobs"], theirs["running_ops"]) == (bob_live, 0)
        assert (everyone["active_sub_jobs"], everyone["running_ops"]) == (1 + bob_live, 1)
        assert http.get("/status", headers=bearer(BOB)).json()["running_ops"] == 0
        assert http.get("/status", headers=bearer(ALICE)).json()["running_ops"] == 1
    finally:
        release.set()
        op.join(120)
        hook.remove()
    assert answers[0].status_code == 200, answers[0].text


def test_model_bytes_per_tenant_are_capped_before_anything_loads(tmp_path):
    tiny = weight_bytes(local_model_path(TINY))
    quota = TenantQuota(max_model_bytes_per_tenant=tiny * 3 // 2)
    service = Service(ServiceSettings(data_dir=tmp_path / "data", device="cpu", quota=quota))
    try:
        folder = service.paths.tenant_root(None) / "my-model"
        shutil.copytree(local_model_path(TINY), folder)
        first = service.create_job(
            {"sub_job_configs": [sub_job("sampling", model_name="my-model")]}
        )
        with pytest.raises(Conflict, match="--max-model-bytes-per-tenant") as refused:
            service.create_job({"sub_job_configs": [sub_job("sampling", model_name="my-model")]})
        assert refused.value.code == "limit_exceeded"
        assert refused.value.details["value"] == 2 * tiny
        assert [j["job_id"] for j in service.list_jobs()] == [first["job_id"]]
        # a built-in (or hub) model is measured once its folder exists, before it loads
        late = service.create_job(job_request("sampling"))
        with pytest.raises(Conflict, match="--max-model-bytes-per-tenant"):
            service.wait_until_running(late["job_id"], timeout=120)
        assert service.get_job(late["job_id"])["status"] == "failed"
        service.cancel_job(first["job_id"])
        assert service.create_job(job_request("sampling"))["job_id"]
    finally:
        service.close()


def test_serve_flags_set_the_quota(monkeypatch):
    from typer.testing import CliRunner

    from arctic_platform import cli
    from arctic_platform.server import serve
    from arctic_platform.server.tenant_quota import DEFAULT_MAX_JOBS_PER_TENANT

    seen = []
    monkeypatch.setattr(serve, "serve", lambda **kwargs: seen.append(kwargs["quota"]))
    assert CliRunner().invoke(cli.app, ["serve"]).exit_code == 0
    flags = ["--max-jobs-per-tenant", "3", "--max-model-bytes-per-tenant", "1000"]
    assert CliRunner().invoke(cli.app, ["serve", *flags]).exit_code == 0
    assert seen == [
        TenantQuota(max_jobs_per_tenant=DEFAULT_MAX_JOBS_PER_TENANT),
        TenantQuota(max_jobs_per_tenant=3, max_model_bytes_per_tenant=1000),
    ]
    refused = CliRunner().invoke(cli.app, ["serve", "--max-jobs-per-tenant", "0"])
    assert refused.exit_code == 2 and "--max-jobs-per-tenant" in refused.output
