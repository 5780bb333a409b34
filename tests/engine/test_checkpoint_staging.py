"""Publishing over an existing checkpoint survives a kill at every step: after :func:`recover` the
name holds the complete old version or the complete new one, and no leftover remains."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from arctic_platform.engine import checkpoint_staging as staging
from arctic_platform.engine.errors import CheckpointWriteError


class Killed(BaseException):
    """The process dying at this point (nothing after it runs)."""


def version(folder: Path, text: str) -> None:
    (folder / "sub").mkdir(parents=True)
    (folder / "weights.bin").write_text(text)
    (folder / "sub" / "state.json").write_text(text)


def contents(folder: Path) -> set[str]:
    return {p.read_text() for p in folder.rglob("*") if p.is_file()}


# The filesystem steps of an overwrite, in order; a kill lands just before the n-th of them.
STEPS = [("rename", 1), ("rename", 2), ("rmtree", 1)]


@pytest.mark.parametrize(("step", "nth"), STEPS, ids=[f"{s}-{n}" for s, n in STEPS])
def test_an_overwrite_killed_at_any_step_leaves_the_old_or_the_new_version(
    tmp_path, monkeypatch, step, nth
):
    final = tmp_path / "s1"
    version(final, "old")
    calls = {"rename": 0, "rmtree": 0}
    real = {"rename": Path.rename, "rmtree": shutil.rmtree}

    def dying(kind):
        def call(*args, **kwargs):
            calls[kind] += 1
            if (kind, calls[kind]) == (step, nth):
                raise Killed
            return real[kind](*args, **kwargs)

        return call

    monkeypatch.setattr(Path, "rename", dying("rename"))
    monkeypatch.setattr(staging.shutil, "rmtree", dying("rmtree"))
    with pytest.raises(Killed):
        staging.publish(_staged(tmp_path, "s1", "new"), final)
    monkeypatch.undo()

    staging.recover([tmp_path])
    assert contents(final) in ({"old"}, {"new"})
    assert [p.name for p in tmp_path.iterdir()] == ["s1"]
    if step == "rename" and nth == 1:
        assert contents(final) == {"old"}  # the new version was never in place


def test_staged_publishes_on_success_and_keeps_the_old_version_on_an_error(tmp_path):
    final = tmp_path / "run" / "s1"
    with staging.staged(final) as folder:
        version(folder, "first")
    with pytest.raises(RuntimeError), staging.staged(final) as folder:
        version(folder, "half")
        raise RuntimeError("the save failed")
    assert contents(final) == {"first"} and sorted(final.parent.iterdir()) == [final]


def test_a_filesystem_error_while_staging_is_a_checkpoint_write_error(tmp_path):
    (tmp_path / "blocker").write_text("a file")
    with pytest.raises(CheckpointWriteError) as caught, staging.staged(tmp_path / "blocker" / "s1"):
        pass
    assert caught.value.errno is not None and str(tmp_path) not in str(caught.value)


def test_a_removal_killed_half_way_leaves_nothing_under_the_name(tmp_path, monkeypatch):
    final = tmp_path / "s1"
    version(final, "old")

    def killed(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(staging.shutil, "rmtree", killed)
    with pytest.raises(Killed):
        staging.remove_published(final)
    monkeypatch.undo()
    assert not final.exists()
    staging.recover([tmp_path])
    assert list(tmp_path.iterdir()) == []


def _staged(parent: Path, name: str, text: str) -> Path:
    folder = staging.new_staging_dir(parent, name)
    version(folder / "inner", text)
    return folder
