"""Hostile checkpoint requests on the on-prem, Cortex and jobs APIs and in process: a bad name or
path is a 400 naming the field before anything is queued, a save the filesystem refuses fails the
request and not the job, a missing checkpoint is a 404 on every route that loads one, and no
answer or error shows where the server keeps its data.

One server and one training job serve every case (each case checks the job is still running and
still saves)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import httpx
import pytest

from arctic_platform.engine import checkpoint as ckpt
from arctic_platform.engine import checkpoint_layout as layout
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.errors import BadRequest, NotFound
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, make_app, sub_job
from tests.server.test_cortex import wait
from tests.waiting import wait_until

TOKEN = "alice-token"
ALICE = TokenAuth([TOKEN]).owner(f"Bearer {TOKEN}")  # the tenant the token is
LONG_PART = "p" * 300


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = Service(ServiceSettings(data_dir=tmp_path_factory.mktemp("data"), device="cpu"))
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def http(service):
    with (
        serve_app(make_app(service, tokens=[TOKEN])) as url,
        httpx.Client(
            base_url=url, timeout=120, headers={"authorization": f"Bearer {TOKEN}"}
        ) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def job(service, http) -> str:
    response = http.post(CORTEX, json={"sub_job_configs": [sub_job("training")]})
    assert response.status_code == 200, response.text
    job_id = response.json()["job_id"]
    service.wait_until_running(job_id, owner=ALICE, timeout=120)
    return job_id


def data_dir(service) -> str:
    return str(service.settings.data_dir.resolve())


def assert_no_server_path(service, text: str) -> None:
    assert data_dir(service) not in text and str(service.settings.data_dir) not in text, text


def assert_job_still_saves(service, http, job: str) -> dict:
    """The job runs on, and its next save works and answers a path that loads back."""
    assert service.get_job(job, owner=ALICE)["status"] == "running"
    saved = http.post(f"/save?job_id={job}", json={"path": "after"})
    assert saved.status_code == 200, saved.text
    loaded = http.post(f"/load-checkpoint?job_id={job}", json={"path": saved.json()["path"]})
    assert loaded.status_code == 200, loaded.text
    return saved.json()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"path": f"runs/{LONG_PART}"}, "save.path"),
        ({"path": "runs/a\x00b"}, "save.path"),
        ({"path": "runs/\x07bell"}, "save.path"),
        ({"path": "r/" * 1700}, "save.path"),
        ({"step": 10**300}, "step"),
    ],
    ids=["part-over-255-bytes", "nul", "control-character", "path-over-3331-bytes", "huge-step"],
)
def test_a_bad_save_path_is_a_400_naming_the_field_on_every_surface(
    service, http, job, body, field
):
    onprem = http.post(f"/save?job_id={job}", json=body)
    assert onprem.status_code == 400 and field in onprem.json()["message"], onprem.text
    assert_no_server_path(service, onprem.text)
    cortex = http.post(f"{CORTEX}/{job}/save", json=body)
    assert cortex.status_code == 400 and field in cortex.json()["message"], cortex.text
    with pytest.raises(BadRequest, match=field):
        service.execute(job, "save", body, owner=ALICE)
    with pytest.raises(BadRequest, match=field.replace("save.", "load.")):
        service.execute(job, "load-checkpoint", body, owner=ALICE)
    assert_job_still_saves(service, http, job)


def test_a_save_the_filesystem_refuses_fails_the_request_not_the_job(service, http, job):
    # "blocker" is a file: the save's folder cannot be made under it (ENOTDIR at save time).
    (service.paths.tenant_root(ALICE) / "blocker").write_text("a file, not a folder")
    refused = http.post(f"/save?job_id={job}", json={"path": "blocker/run"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["field"] == "path" and "Not a directory" in refused.json()["message"]
    assert_no_server_path(service, refused.text)
    request_id = http.post(f"{CORTEX}/{job}/save", json={"path": "blocker/run"}).json()
    poll = http.get(f"{CORTEX}/{job}/requests/{request_id['request_id']}")
    while poll.json()["status"] in ("pending", "running"):
        poll = http.get(f"{CORTEX}/{job}/requests/{request_id['request_id']}")
    assert poll.json()["status"] == "failed" and "Not a directory" in poll.json()["error"]
    assert_no_server_path(service, poll.text)
    assert_job_still_saves(service, http, job)


def test_a_full_disk_fails_the_save_with_507_and_keeps_the_job_and_its_checkpoints(
    service, http, job, monkeypatch
):
    before = assert_job_still_saves(service, http, job)
    real_save = ckpt.torch.save

    def disk_full(obj, path, *args, **kwargs):  # stands in for the disk: the subject is the answer
        if str(path).endswith(layout.RNG_FILE):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", disk_full)
    full = http.post(f"/save?job_id={job}", json={"path": "after"})
    assert full.status_code == 507 and full.json()["code"] == "insufficient_storage", full.text
    assert_no_server_path(service, full.text)
    monkeypatch.undo()
    loaded = http.post(f"/load-checkpoint?job_id={job}", json={"path": before["path"]})
    assert loaded.status_code == 200, loaded.text  # the earlier version is intact
    assert_job_still_saves(service, http, job)


def test_save_answers_name_paths_in_the_tenants_space_and_load_back(service, http, job):
    for body in ({}, {"path": "runs/x", "export_hf": True}):
        saved = http.post(f"/save?job_id={job}", json=body)
        assert saved.status_code == 200, saved.text
        answer = saved.json()
        assert_no_server_path(service, saved.text)
        root = service.paths.tenant_root(ALICE)
        for key in ("path", "checkpoint_path", "hf_path"):
            if answer[key] is not None:
                assert not Path(answer[key]).is_absolute() and (root / answer[key]).is_dir(), key
        loaded = http.post(f"/load-checkpoint?job_id={job}", json={"path": answer["path"]})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["path"] == answer["path"]
        in_process = service.execute(job, "save", body, owner=ALICE)
        assert in_process["path"] == answer["path"]
    for route in (f"/jobs/{job}", f"{CORTEX}/{job}", f"/jobs/{job}/checkpoints"):
        assert_no_server_path(service, http.get(route).text)
    outside = http.post(f"/save?job_id={job}", json={"path": "/etc/x"})
    assert outside.status_code == 400
    assert_no_server_path(service, outside.text)


def test_a_missing_checkpoint_is_a_404_on_every_route_that_loads_one(service, http, job):
    request_id = http.post(f"{CORTEX}/{job}/save", json={"path": "doomed"}).json()["request_id"]
    saved = wait(http, job, request_id)
    folder = service.paths.tenant_root(ALICE) / "doomed" / saved["checkpoint_id"]
    (folder / layout.TRAINER_STATE).unlink()  # files lost behind the server's back

    by_path = http.post(f"/load-checkpoint?job_id={job}", json={"path": "doomed"})
    assert by_path.status_code == 404 and by_path.json()["code"] == "not_found", by_path.text
    absent = http.post(f"/load-checkpoint?job_id={job}", json={"path": "never-saved"})
    assert absent.status_code == 404, absent.text
    by_id = {"checkpoint_id": saved["checkpoint_id"]}
    onprem = http.post(f"/load-checkpoint?job_id={job}", json=by_id)
    assert onprem.status_code == 404, onprem.text
    request_id = http.post(f"{CORTEX}/{job}/load", json=by_id).json()["request_id"]

    def ended() -> dict | None:
        body = http.get(f"{CORTEX}/{job}/requests/{request_id}").json()
        return None if body["status"] in ("pending", "running") else body

    polled = wait_until(ended, what="the Cortex load")
    # The failure reads as the on-prem API answers it; no Python class name on the wire.
    assert polled["status"] == "failed", polled
    assert polled["error_detail"] == {"status": 404, **onprem.json()}, polled
    assert polled["error"] == onprem.json()["message"]
    with pytest.raises(NotFound):
        service.execute(job, "load-checkpoint", by_id, owner=ALICE)
    source = {"source_job_id": job, "checkpoint_id": saved["checkpoint_id"]}
    spec = {"sub_job_configs": [sub_job("training", source_checkpoint_info=source)]}
    created = http.post(CORTEX, json=spec)
    assert created.status_code == 404 and "source_checkpoint_info" in created.text, created.text
    shutil.rmtree(folder)
    assert http.post(f"/load-checkpoint?job_id={job}", json=by_id).status_code == 404
    for answer in (by_path, absent, onprem, created):
        assert_no_server_path(service, answer.text)
    assert_no_server_path(service, str(polled))
    assert_job_still_saves(service, http, job)
