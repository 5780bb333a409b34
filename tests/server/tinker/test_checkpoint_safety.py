"""Hostile checkpoint requests on the Tinker API: a bad name is a 400 naming the field that leaves
the training run as it was, a checkpoint whose files are gone is a 404 (never a 500) and is not
listed, and no answer shows where the server keeps its data."""

from __future__ import annotations

import shutil

import pytest

from arctic_platform.engine import checkpoint_layout as layout
from tests.server.tinker.conftest import encode
from tests.server.tinker.plain_http import PROTOBUF

pytestmark = pytest.mark.slow  # merged HF exports of every kind of save

SAVES = ("save_weights", "save_weights_for_sampler", "save_weights_external")
BAD_NAMES = {
    "over-255-bytes": "n" * 300,
    "too-long-to-stage": "n" * 250,  # fits a filesystem name, not with the staging prefix
    "nul": "a\x00b",
    "control-character": "a\nb",
    "hidden": ".tmp-s1-0123",
    "slash": "a/b",
    "dot-dot": "..",
}


def data_dir(server_app) -> str:
    return str(server_app.state.service.settings.data_dir.resolve())


def test_a_bad_checkpoint_name_is_a_400_and_the_run_goes_on(alice, run, server_app):
    _, model_id = run
    for case, name in BAD_NAMES.items():
        for route in SAVES:
            refused = alice.save(route, model_id, name)
            assert refused.status_code == 400, (case, route, refused.text)
            assert refused.json()["message"].startswith("path:"), refused.text
            assert data_dir(server_app) not in refused.text
        path = f"tinker://{model_id}/weights/{name}"
        load = alice.post("load_weights", {"model_id": model_id, "path": path, "optimizer": False})
        assert load.status_code == 400 and "path" in load.text, (case, load.text)
    deleted = alice.http.delete(f"/training_runs/{model_id}/checkpoints/weights/{'n' * 300}")
    assert deleted.status_code == 400 and "checkpoint" in deleted.text, deleted.text
    # The run is untouched: the next saves and a training step work.
    for route in SAVES:
        alice.ok(alice.save(route, model_id, "fine").json()["request_id"])
    step = {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}}
    alice.ok(alice.submit("optim_step", step))


def test_a_checkpoint_whose_files_are_gone_is_a_404_and_not_listed(alice, run, server_app):
    session, model_id = run
    service = server_app.state.service
    for route, name in (("save_weights", "lost"), ("save_weights_for_sampler", "lost")):
        alice.ok(alice.save(route, model_id, name).json()["request_id"])
    kinds = {c["tinker_path"].split("/")[-2] for c in alice.checkpoints(model_id)}
    assert {"weights", "sampler_weights"} <= kinds
    (tinker_root,) = service.paths.root.glob("*/tinker")
    runs = tinker_root / "runs" / model_id.replace(":", "_")
    for kind in ("weights", "sampler_weights"):  # files lost behind the server's back
        for state in (runs / kind / "lost").rglob(layout.TRAINER_STATE):
            state.unlink()
    listed = {c["tinker_path"] for c in alice.checkpoints(model_id)}
    assert not any(path.endswith("/lost") for path in listed), listed

    sampled = alice.sample(session, f"tinker://{model_id}/sampler_weights/lost", encode("1+1="))
    assert sampled.status_code == 404 and sampled.json()["code"] == "not_found", sampled.text
    loaded = alice.post(
        "load_weights",
        {"model_id": model_id, "path": f"tinker://{model_id}/weights/lost", "optimizer": True},
    )
    assert loaded.status_code == 404, loaded.text
    shutil.rmtree(runs / "sampler_weights" / "lost")
    gone = alice.sample(session, f"tinker://{model_id}/sampler_weights/lost", encode("1+1="))
    assert gone.status_code == 404, gone.text
    for answer in (sampled, loaded, gone):
        assert data_dir(server_app) not in answer.text

    # A listed checkpoint loads and samples.
    alice.ok(alice.save("save_weights_for_sampler", model_id, "kept").json()["request_id"])
    kept = alice.sample(session, f"tinker://{model_id}/sampler_weights/kept", encode("1+1="), seq=1)
    assert kept.status_code == 200 and kept.headers["content-type"] == PROTOBUF, kept.text


def test_a_run_folder_linked_out_of_the_space_is_not_followed(alice, run, server_app, tmp_path):
    """A tenant with a hand in its folder (a shared filesystem) links its run's folder out:
    saves wrote through the link and loads read through it. Both are refused now, and nothing
    outside changes."""
    _, model_id = run
    alice.ok(alice.save("save_weights", model_id, "kept").json()["request_id"])
    (tinker_root,) = server_app.state.service.paths.root.glob("*/tinker")
    run_dir = tinker_root / "runs" / model_id.replace(":", "_")
    outside = tmp_path / "outside"
    outside.mkdir()
    moved = tmp_path / "moved"
    run_dir.rename(moved)
    run_dir.symlink_to(outside, target_is_directory=True)
    try:
        answer = alice.result(alice.save("save_weights", model_id, "escape").json()["request_id"])
        assert "error" in answer.json() and "path" in answer.json()["error"], answer.text
        assert list(outside.iterdir()) == []
        shutil.copytree(moved, outside, dirs_exist_ok=True)  # the run's own checkpoint, outside
        path = f"tinker://{model_id}/weights/kept"
        load = alice.post("load_weights", {"model_id": model_id, "path": path, "optimizer": False})
        assert load.status_code == 400 and load.json()["field"] == "path", load.text
        assert load.json()["code"] == "path_not_allowed"
    finally:
        run_dir.unlink()
        moved.rename(run_dir)
