"""Client-supplied paths stay inside the caller's tenant folder (or the operator's read-only
prefixes): absolute paths, ``..``, symlinks and other tenants' folders are 400s naming the field,
and nothing outside is written, deleted or read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from arctic_platform.engine.builtin import builtin_model_path
from arctic_platform.server.errors import BadRequest, NotFound
from arctic_platform.server.service import Service, ServiceSettings
from tests.server.conftest import CORTEX, TINY, job_request, sub_job

ALICE, BOB = "alice", "bob"


def running(service: Service, owner: str, *kinds: str, **extra) -> str:
    spec = [sub_job(k, **extra) for k in kinds or ("training",)]
    job_id = service.create_job({"sub_job_configs": spec}, owner=owner)["job_id"]
    service.wait_until_running(job_id, owner=owner, timeout=120)
    return job_id


def victim_folder(tmp_path: Path) -> Path:
    """A folder outside the data dir holding what a careless retention would delete."""
    victim = tmp_path / "victim"
    for name in ("checkpoint-1", "checkpoint-2", "other"):
        (victim / name).mkdir(parents=True)
        (victim / name / "keep.txt").write_text(name)
    return victim


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def refused(call, field: str) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        call()
    assert caught.value.status == 400 and field in caught.value.message
    return caught.value


def test_save_paths_outside_the_tenant_are_refused_and_nothing_outside_changes(service, tmp_path):
    job = running(service, ALICE)
    victim = victim_folder(tmp_path)
    before = tree(victim)
    escape = os.path.relpath(tmp_path / "outside", service.paths.tenant_root(ALICE))
    for path in (str(victim), "../../outside", escape, "/etc"):
        body = {"path": path, "save_total_limit": 1}
        refused(lambda b=body: service.execute(job, "save", b, owner=ALICE), "save.path")
    assert tree(victim) == before
    assert not (tmp_path / "outside").exists()


def test_a_symlink_out_of_the_tenant_folder_is_refused(service, tmp_path):
    job = running(service, ALICE)
    victim = victim_folder(tmp_path)
    before = tree(victim)
    link = service.paths.tenant_root(ALICE) / "link"
    link.symlink_to(victim, target_is_directory=True)
    refused(lambda: service.execute(job, "save", {"path": "link"}, owner=ALICE), "save.path")
    refused(lambda: service.execute(job, "save", {"path": "link/sub"}, owner=ALICE), "save.path")
    refused(
        lambda: service.execute(job, "load-checkpoint", {"path": "link"}, owner=ALICE), "load.path"
    )
    assert tree(victim) == before


def test_a_link_planted_as_the_jobs_own_folder_is_followed_nowhere(service, tmp_path):
    """A tenant with a hand in its folder (a shared filesystem) links its job's own checkpoint
    folder out: saves with no path wrote there and pruned what they found, and loads read
    another tenant's checkpoint. Now what a save or load touches is resolved when it runs."""
    job = running(service, ALICE)
    bobs = running(service, BOB)
    service.execute(bobs, "save", {"step": 1}, owner=BOB)
    victim = victim_folder(tmp_path)
    before = tree(victim)
    own = service.paths.checkpoint_root(ALICE) / f"{job}-training-0"
    own.parent.mkdir(parents=True, exist_ok=True)
    own.symlink_to(victim, target_is_directory=True)
    save = {"step": 9, "save_total_limit": 1}
    refused(lambda: service.execute(job, "save", save, owner=ALICE), "save.path")
    assert tree(victim) == before
    own.unlink()
    own.symlink_to(service.paths.checkpoint_root(BOB) / f"{bobs}-training-0")
    refused(lambda: service.execute(job, "load-checkpoint", {"step": 1}, owner=ALICE), "load.path")
    refused(lambda: service.execute(job, "save", {"step": 1}, owner=ALICE), "save.path")

    # The job's folder its own, a checkpoint in it linked out: not loaded, and retention
    # removes the link, not what it points at.
    own.unlink()
    service.execute(job, "save", {"step": 2}, owner=ALICE)
    (own / "checkpoint-1").symlink_to(victim / "checkpoint-1", target_is_directory=True)
    (victim / "checkpoint-1" / "trainer_state.json").write_text("{}")
    before = tree(victim)
    refused(lambda: service.execute(job, "load-checkpoint", {"step": 1}, owner=ALICE), "load.path")
    service.execute(job, "save", {"step": 3, "save_total_limit": 1}, owner=ALICE)
    assert sorted(p.name for p in own.glob("checkpoint-*")) == ["checkpoint-3"]
    assert tree(victim) == before


def test_paths_inside_the_tenant_folder_save_and_load(service):
    job = running(service, ALICE)
    saved = service.execute(job, "save", {"path": "runs/a"}, owner=ALICE)
    assert saved["path"] == "runs/a/checkpoint-0"  # named relative to the tenant's space
    assert (service.paths.tenant_root(ALICE) / saved["path"]).is_dir()
    loaded = service.execute(job, "load-checkpoint", {"path": "runs/a"}, owner=ALICE)
    assert loaded["global_step"] == 0
    default = service.execute(job, "save", {}, owner=ALICE)
    folder = service.paths.tenant_root(ALICE) / default["path"]
    assert folder.is_dir() and folder.is_relative_to(service.paths.checkpoint_root(ALICE))


def test_retention_applies_only_to_the_jobs_own_folder(service):
    job = running(service, ALICE)
    folder = service.paths.tenant_root(ALICE) / "shared"
    (folder / "checkpoint-7").mkdir(parents=True)
    refused(
        lambda: service.execute(
            job, "save", {"path": "shared", "save_total_limit": 1}, owner=ALICE
        ),
        "save_total_limit",
    )
    service.execute(job, "save", {"path": "shared"}, owner=ALICE)
    assert (folder / "checkpoint-7").is_dir()  # a save elsewhere deletes nothing
    for step in (1, 2, 3):
        service.execute(job, "save", {"step": step, "save_total_limit": 2}, owner=ALICE)
    own = service.paths.checkpoint_root(ALICE) / f"{job}-training-0"
    assert sorted(p.name for p in own.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


def test_one_tenant_cannot_write_read_or_load_another_tenants_checkpoints(service):
    alice = running(service, ALICE)
    saved = service.execute(alice, "save", {}, owner=ALICE)
    alice_checkpoint = str(service.paths.tenant_root(ALICE) / saved["path"])
    alice_folder = Path(alice_checkpoint).parent
    before = tree(alice_folder)
    bob = running(service, BOB)
    # B saves into A's job folder, by absolute path and by a relative escape.
    escape = os.path.relpath(alice_folder, service.paths.tenant_root(BOB))
    for path in (str(alice_folder), escape):
        refused(lambda p=path: service.execute(bob, "save", {"path": p}, owner=BOB), "save.path")
        refused(
            lambda p=path: service.execute(bob, "load-checkpoint", {"path": p}, owner=BOB),
            "load.path",
        )
    assert tree(alice_folder) == before
    # B starts a job whose model is A's checkpoint folder.
    spec = {"sub_job_configs": [sub_job("sampling", model_name=alice_checkpoint)]}
    refused(lambda: service.create_job(spec, owner=BOB), "sub_job_configs.0.model_name")
    # B names A's checkpoint as its source: not found among B's jobs.
    source = {
        "sub_job_configs": [
            sub_job(
                "training",
                source_checkpoint_info={
                    "source_job_id": alice,
                    "checkpoint_id": saved["checkpoint_id"],
                },
            )
        ]
    }
    with pytest.raises(NotFound, match="source_checkpoint_info"):
        service.create_job(source, owner=BOB)
    # A can start from its own checkpoint folder.
    own = {"sub_job_configs": [sub_job("sampling", model_name=saved["path"])]}  # a shown path
    job_id = service.create_job(own, owner=ALICE)["job_id"]
    assert service.wait_until_running(job_id, owner=ALICE, timeout=120)["status"] == "running"


def test_model_folders_outside_need_an_operator_allowed_prefix(tmp_path):
    model = Path(builtin_model_path(TINY))
    spec = {"sub_job_configs": [sub_job("sampling", model_name=str(model))]}
    closed = Service(ServiceSettings(data_dir=tmp_path / "a", device="cpu"))
    try:
        refused(lambda: closed.create_job(spec, owner=ALICE), "sub_job_configs.0.model_name")
        refused(
            lambda: closed.create_job(
                {"sub_job_configs": [sub_job("sampling", model_name="../../x")]}, owner=ALICE
            ),
            "model_name",
        )
    finally:
        closed.close()
    allowed = Service(
        ServiceSettings(data_dir=tmp_path / "b", device="cpu", allowed_paths=(model.parent,))
    )
    try:
        job_id = allowed.create_job(spec, owner=ALICE)["job_id"]
        assert allowed.wait_until_running(job_id, owner=ALICE, timeout=120)["status"] == "running"
        # Allowed prefixes are read-only: a save there is refused.
        trainer = running(allowed, ALICE)
        refused(
            lambda: allowed.execute(trainer, "save", {"path": str(model.parent)}, owner=ALICE),
            "save.path",
        )
    finally:
        allowed.close()


def test_exports_list_no_file_that_links_out_of_the_checkpoint(service, tmp_path):
    job = running(service, ALICE)
    saved = service.execute(job, "save", {}, owner=ALICE)
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (service.paths.tenant_root(ALICE) / saved["path"] / "leak.txt").symlink_to(secret)
    files = service.checkpoint_files(job, saved["checkpoint_id"], owner=ALICE)
    names = {f["filename"] for f in files}
    assert "leak.txt" not in names and "trainer_state.json" in names
    # One file is served by its name alone (not by listing the folder, which took seconds on
    # the event loop for a checkpoint of many files): the same rule, links out and '..' refused.
    checkpoint = saved["checkpoint_id"]
    state = service.checkpoint_file(job, checkpoint, "trainer_state.json", owner=ALICE)
    assert state.name == "trainer_state.json" and state.is_file()
    for name in ("leak.txt", "../latest", "../../" * 8 + "etc/passwd"):
        with pytest.raises(NotFound):
            service.checkpoint_file(job, checkpoint, name, owner=ALICE)


def test_an_unconfined_in_process_service_keeps_the_callers_paths(tmp_path):
    service = Service(ServiceSettings(data_dir=tmp_path / "d", device="cpu", confine_paths=False))
    try:
        job = running(service, None)
        saved = service.execute(job, "save", {"path": str(tmp_path / "mine")}, owner=None)
        assert Path(saved["path"]) == tmp_path / "mine" / "checkpoint-0"
    finally:
        service.close()


def test_default_job_requests_are_unaffected(service):
    job_id = service.create_job(job_request("training"))["job_id"]
    assert service.wait_until_running(job_id, timeout=120)["status"] == "running"


def test_checkpoints_of_the_layout_before_tenant_folders_move_to_their_owner(tmp_path, caplog):
    # What a server of the earlier layout left: alice's job and its checkpoint record pointing at
    # <data-dir>/checkpoints/<sub-job>/, plus a folder no job of this server owns.
    from arctic_platform.server.store import MetadataStore

    data = tmp_path / "data"
    legacy = data / "checkpoints"
    saved = legacy / "a11ce0000000-training-0" / "checkpoint-1"
    saved.mkdir(parents=True)
    (saved / "model.safetensors").write_bytes(b"weights")
    stray = legacy / "0123456789ab-training-0" / "checkpoint-1"
    stray.mkdir(parents=True)
    store = MetadataStore(data / "metadata.sqlite3")
    store.put_job(
        {
            "job_id": "a11ce0000000",
            "owner": ALICE,
            "status": "running",
            "reason": None,
            "experiment_name": None,
            "request": job_request("training"),
            "sub_jobs": [{"sub_job_id": "a11ce0000000:training:0", "kind": "training"}],
            "created_at": 1.0,
            "updated_at": 1.0,
        }
    )
    record = {"job_id": "a11ce0000000", "sub_job_id": "a11ce0000000:training:0"}
    record |= {"checkpoint_id": "checkpoint-1", "path": str(saved), "global_steps": 1}
    store.put_checkpoint(record | {"avg_loss": 0.5, "checkpoint_type": "full", "created_at": 2.0})
    store.close()

    service = Service(ServiceSettings(data_dir=data, device="cpu"))
    try:
        files = service.checkpoint_files("a11ce0000000", "checkpoint-1", owner=ALICE)
        moved = service.paths.checkpoint_root(ALICE) / "a11ce0000000-training-0" / "checkpoint-1"
        assert [(f["filename"], f["path"]) for f in files] == [
            ("model.safetensors", str(moved / "model.safetensors"))
        ]
        assert not saved.exists() and stray.exists()
        with pytest.raises(NotFound):
            service.checkpoint_files("a11ce0000000", "checkpoint-1", owner=BOB)
        with pytest.raises(BadRequest, match="load_path"):  # not handed to anyone by path
            service.paths.readable(BOB, str(stray), field="load_path")
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(str(stray.parent) in m and "not served" in m for m in warned), warned
    finally:
        service.close()


def test_an_operator_writable_prefix_takes_absolute_saves_and_nothing_beyond(tmp_path):
    writable = tmp_path / "ckpts"
    service = Service(
        ServiceSettings(data_dir=tmp_path / "data", device="cpu", writable_paths=(writable,))
    )
    try:
        job = running(service, ALICE)
        target = writable / "run-1"  # absolute, as SkyRL's trainer.ckpt_path
        saved = service.execute(job, "save", {"path": str(target)}, owner=ALICE)
        assert Path(saved["path"]) == target / "checkpoint-0" and Path(saved["path"]).is_dir()
        loaded = service.execute(job, "load-checkpoint", {"path": str(target)}, owner=ALICE)
        assert loaded["global_step"] == 0
        for path in (str(tmp_path / "elsewhere"), f"{writable}/../elsewhere"):
            error = refused(
                lambda p=path: service.execute(job, "save", {"path": p}, owner=ALICE), "save.path"
            )
            assert error.code == "path_not_allowed" and str(writable) in error.message
        assert not (tmp_path / "elsewhere").exists()
    finally:
        service.close()


def test_a_sub_jobs_own_checkpoint_root_is_confined_like_every_path(service, tmp_path):
    """``training_config.checkpoint_dir`` (the on-prem reference's ``checkpoint_path``) is checked
    at creation, before any job exists, and recorded resolved inside the owner's space."""
    for outside in (str(tmp_path / "elsewhere"), "../bob/runs"):
        spec = sub_job("training", training_config={"checkpoint_dir": outside})
        refused(
            lambda s=spec: service.create_job({"sub_job_configs": [s]}, owner=ALICE),
            "sub_job_configs.0.training_config.checkpoint_dir",
        )
    assert service.list_jobs(owner=ALICE) == []
    spec = sub_job("training", training_config={"checkpoint_dir": "runs"})
    info = service.create_job({"sub_job_configs": [spec]}, owner=ALICE)
    recorded = service.job_request(info["job_id"], owner=ALICE)["sub_job_configs"][0]
    assert recorded["training_config"]["checkpoint_dir"] == "runs"  # as the tenant named it
    used = service.resolve(info["job_id"], owner=ALICE, kind="training").spec.training_config
    expected = service.paths.tenant_root(ALICE) / "runs"
    assert used.checkpoint_dir == str(expected.resolve())
    service.cancel_job(info["job_id"], owner=ALICE)


@pytest.mark.parametrize(
    "name",
    ["x" * 300, "org/" + "y" * 256, "builtin:" + "x" * 5000, "builtin:../../x", "a\x00b", "a/b/c"],
    ids=["long name", "long part", "long built-in", "no such built-in", "NUL", "no such folder"],
)
def test_a_model_name_no_model_could_have_is_a_400_naming_it(http, service, name):
    """Checked before any file is looked up by it (a part over 255 bytes was a 500, 'File name
    too long'), and a built-in, or a path that is neither a folder nor a hub id, that does not
    exist before a job is made for it (it failed the job once built): on Cortex, on-prem and in
    the Service alike."""
    spec = sub_job("training", model_name=name)
    cortex = http.post(CORTEX, json={"sub_job_configs": [spec]})
    onprem = http.post("/initialize", json=spec)
    for answer in (cortex, onprem):
        assert answer.status_code == 400, answer.text
        assert answer.json()["field"].endswith("model_name"), answer.text
    with pytest.raises(BadRequest, match="model_name"):
        service.create_job({"sub_job_configs": [spec]}, owner=ALICE)
    assert service.list_jobs() == []
