"""A tenant's checkpoints are bounded in bytes, on every API that saves them.

Saves land on the server's one disk: a tenant saving in a loop would fill it, and every other
tenant's next save would fail and cost them their run. With ``--max-checkpoint-bytes-per-tenant``
a save that would pass the bound (what the tenant's catalogued checkpoints hold, plus this one
estimated as its job's newest) is refused with 409 ``limit_exceeded`` before anything is written,
on the on-prem, Cortex and Tinker APIs and in process alike; another tenant is not held back, the
job goes on, and deleting a checkpoint makes room. Real server over 127.0.0.1, real ``builtin:tiny``
engines; the bound is set once the first checkpoint's size is known.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from arctic_platform.server.checkpoint_catalogue import folder_bytes
from arctic_platform.server.errors import Conflict
from arctic_platform.server.service import Service, ServiceSettings
from arctic_platform.server.tenant_quota import TenantQuota
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, job_request, make_app
from tests.server.test_hostile_uploads import ALICE, BOB, credentials
from tests.server.tinker.plain_http import TinkerHttp
from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # three training engines and a Tinker run
FLAG = "--max-checkpoint-bytes-per-tenant"


def _cortex_outcome(http: httpx.Client, job: str, request_id: str) -> dict:
    def finished() -> dict | None:
        body = http.get(f"{CORTEX}/{job}/requests/{request_id}").json()
        return body if body["status"] in ("done", "failed") else None

    return wait_until(finished, what=f"request {request_id}")


def _bound(service: Service, nbytes: int) -> None:
    service.jobs.quota = TenantQuota(max_checkpoint_bytes_per_tenant=nbytes)


def _assert_refused(answer: httpx.Response) -> None:
    assert answer.status_code == 409, answer.text
    body = answer.json()
    assert body["code"] == "limit_exceeded" and body["limit"] == "max_checkpoint_bytes_per_tenant"
    assert FLAG in body["message"]


def test_a_tenants_checkpoints_are_bounded_on_every_api(tmp_path):
    shared = tmp_path / "shared"  # an --allow-write-path folder, outside the tenant folders
    settings = ServiceSettings(data_dir=tmp_path / "data", device="cpu", writable_paths=(shared,))
    service = Service(settings)
    app = make_app(service, tokens=[ALICE, BOB])
    alice, bob = (app.state.auth.owner(f"Bearer {token}") for token in (ALICE, BOB))
    try:
        with (
            serve_app(app) as url,
            httpx.Client(base_url=url, timeout=120, headers=credentials(ALICE)) as http,
            httpx.Client(base_url=url, timeout=120, headers=credentials(BOB)) as bobs_http,
        ):
            jobs = {}
            for owner, client in ((alice, http), (bob, bobs_http)):
                created = client.post(CORTEX, json=job_request("training"))
                assert created.status_code == 200, created.text
                jobs[owner] = created.json()["job_id"]
                service.wait_until_running(jobs[owner], owner=owner, timeout=120)
            job = jobs[alice]
            home = service.paths.tenant_root(alice)

            def save(path: str) -> httpx.Response:
                return http.post(f"/save?job_id={job}", json={"path": path})

            first = save("a1")
            assert first.status_code == 200, first.text
            (record,) = service.store.checkpoints(job)
            folder = Path(record["path"])  # a1/checkpoint-0, beside a1's `latest` pointer
            assert folder.parent == home / "a1"
            files = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]
            size = sum(p.stat().st_size for p in files)
            assert size > 0 and record["nbytes"] == size == folder_bytes(folder)

            _bound(service, size * 5 // 2)  # room for two of Alice's checkpoints, not three
            # Outside her folder, under the shared prefix: counted by its catalogue record. It
            # replaces a1's record (the same step, the same id): a1 is counted in her folder.
            assert save(str(shared / "a2")).status_code == 200
            (record,) = service.store.checkpoints(job)
            assert Path(record["path"]).parent == shared / "a2"
            _assert_refused(save("a3"))
            assert not (home / "a3").exists()

            # Cortex: the save's request fails with the same error; in process, the same.
            request_id = http.post(f"{CORTEX}/{job}/save", json={"path": "a3"}).json()
            failed = _cortex_outcome(http, job, request_id["request_id"])
            assert failed["status"] == "failed" and FLAG in failed.get("error", ""), failed
            with pytest.raises(Conflict, match=FLAG):
                service.execute(job, "save", {"path": "a3"}, owner=alice)
            assert not (home / "a3").exists()

            # Bob is not held back by Alice's checkpoints.
            bobs = bobs_http.post(f"/save?job_id={jobs[bob]}", json={"path": "b1"})
            assert bobs.status_code == 200, bobs.text

            # Deleting a checkpoint (a2, the one catalogued) makes room; the refused saves left
            # the job as it was.
            deleted = http.delete(f"{CORTEX}/{job}/checkpoints/{record['checkpoint_id']}")
            assert deleted.status_code == 204 and not Path(record["path"]).exists()
            again = save("a3")
            assert again.status_code == 200, again.text
            assert service.get_job(job, owner=alice)["status"] == "running"

            # Tinker: a training run is one more of Alice's jobs; its saves count and are
            # refused the same way once the bound is reached.
            tinker = TinkerHttp(url, ALICE)
            try:
                model_id = tinker.training_run(tinker.session(), "builtin:tiny")
                tinker.ok(tinker.save("save_weights", model_id, "t1").json()["request_id"])
                _bound(service, folder_bytes(home))  # full: any save with a size is refused
                answer = tinker.save("save_weights", model_id, "t2").json()
                refused = tinker.result(answer["request_id"])
                assert FLAG in refused.json().get("error", ""), refused.text
                names = {c["tinker_path"].rsplit("/", 1)[1] for c in tinker.checkpoints(model_id)}
                assert names == {"t1"}
            finally:
                tinker.close()
    finally:
        service.close()


def test_folder_bytes_counts_files_not_links_and_skips_what_vanishes(tmp_path, monkeypatch):
    """What a save measures: regular files only (a link to a large file outside is not the
    tenant's bytes), and a file another save removes mid-walk is skipped, not an error."""
    from arctic_platform.server import checkpoint_catalogue

    (tmp_path / "outside").write_bytes(b"x" * 1000)
    folder = tmp_path / "ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "a").write_bytes(b"x" * 10)
    (folder / "sub" / "b").write_bytes(b"x" * 20)
    (folder / "sub" / "gone").write_bytes(b"x" * 40)
    (folder / "link").symlink_to(tmp_path / "outside")
    real_lstat = checkpoint_catalogue.os.lstat

    def vanishing(path, *args, **kwargs):
        if str(path).endswith("gone"):
            raise FileNotFoundError(path)
        return real_lstat(path, *args, **kwargs)

    assert folder_bytes(folder) == 70
    monkeypatch.setattr(checkpoint_catalogue.os, "lstat", vanishing)
    assert folder_bytes(folder) == 30
    assert folder_bytes(tmp_path / "never-made") == 0
