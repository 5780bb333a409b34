"""Checkpoints: bitwise resume, HF layout, retention, atomic saves, LoRA export."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_platform.engine import checkpoint as ckpt
from arctic_platform.engine import checkpoint_staging as staging_files
from arctic_platform.engine.config import LoraConfig, ModelConfig
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.trainer import TrainingEngine
from tests.engine.rl_batches import engine_config, rl_batch

LORA = ModelConfig(name="builtin:tiny", lora=LoraConfig(r=4, dropout=0.2))
SCHEDULE = {"name": "cosine", "warmup_steps": 1, "total_steps": 6}


def weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def train(engine, steps: int, first_seed: int) -> None:
    for i in range(steps):
        engine.forward_backward(rl_batch(rows=4, seed=first_seed + i))
        engine.step()


@pytest.mark.parametrize("model", [None, LORA], ids=["full", "lora-with-dropout"])
def test_resume_from_latest_is_bitwise_identical(tmp_path, model):
    overrides = {"checkpoint_dir": str(tmp_path), "scheduler": SCHEDULE, "optimizer": {"lr": 1e-3}}
    if model is not None:
        overrides["model"] = model
    uninterrupted = TrainingEngine(engine_config(**overrides))
    train(uninterrupted, 2, first_seed=0)
    saved = uninterrupted.save_checkpoint()
    assert saved["global_step"] == 2
    assert saved["checkpoint_id"] == "checkpoint-2"
    assert saved["path"] == str(tmp_path / "default" / "checkpoint-2")
    draws = (torch.rand(3), random.random(), np.random.rand())  # RNG state is part of a resume
    train(uninterrupted, 2, first_seed=2)

    resumed = TrainingEngine(engine_config(**{**overrides, "seed": 1234}))
    loaded = resumed.load_checkpoint()
    assert loaded == {"path": saved["path"], "global_step": 2, "checkpoint_id": "checkpoint-2"}
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(again[0], draws[0]) and again[1:] == draws[1:]
    train(resumed, 2, first_seed=2)

    assert resumed.global_steps == uninterrupted.global_steps == 4
    final, want = weights(resumed), weights(uninterrupted)
    assert all(torch.equal(final[n], want[n]) for n in want)


def test_checkpoint_is_hf_loadable_and_has_all_state(tmp_path):
    engine = TrainingEngine(engine_config(checkpoint_dir=str(tmp_path), job_name="run-7"))
    train(engine, 1, first_seed=0)
    saved = engine.save_checkpoint()
    path = tmp_path / "run-7" / "checkpoint-1"
    assert saved["path"] == saved["hf_path"] == str(path)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "optimizer.pt"} <= names
    assert {"scheduler.pt", "rng_state.pt", "trainer_state.json"} <= names
    assert (tmp_path / "run-7" / "latest").read_text() == "1"
    loaded = AutoModelForCausalLM.from_pretrained(path)
    live = engine.model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, live[name]), name


def test_save_total_limit_keeps_the_newest(tmp_path):
    engine = TrainingEngine(engine_config(checkpoint_dir=str(tmp_path), save_total_limit=2))
    job = tmp_path / "default"
    job.mkdir()
    (job / "notes.txt").write_text("kept")
    (job / "checkpoint-old").mkdir()  # not a checkpoint name: never touched
    for step in (1, 2, 3, 4):
        engine.save_checkpoint(step=step)
    names = sorted(p.name for p in job.iterdir())
    assert names == ["checkpoint-3", "checkpoint-4", "checkpoint-old", "latest", "notes.txt"]
    engine.save_checkpoint(step=9, save_total_limit=1)
    assert sorted(p.name for p in job.glob("checkpoint-*")) == ["checkpoint-9", "checkpoint-old"]


def test_retention_is_refused_for_a_folder_that_is_not_the_jobs_own(tmp_path):
    engine = TrainingEngine(engine_config(checkpoint_dir=str(tmp_path), save_total_limit=1))
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "checkpoint-1").mkdir(parents=True)
    with pytest.raises(EngineInputError, match="save_total_limit"):
        engine.save_checkpoint(elsewhere, step=5, save_total_limit=1)
    engine.save_checkpoint(elsewhere, step=5)  # the config's limit is not applied there
    names = sorted(p.name for p in elsewhere.glob("checkpoint-*"))
    assert names == ["checkpoint-1", "checkpoint-5"]


def test_checkpoint_files_and_folders_are_fsynced_before_the_publishing_rename(
    tmp_path, monkeypatch
):
    engine = TrainingEngine(engine_config(checkpoint_dir=str(tmp_path)))
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = staging_files.os.fsync, Path.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(self, target):
        events.append(("rename", str(target)))
        return real_rename(self, target)

    monkeypatch.setattr(staging_files.os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    saved = engine.save_checkpoint(step=3)
    final = Path(saved["path"])
    publish = events.index(("rename", str(final)))
    synced_before = {Path(path).name for kind, path in events[:publish] if kind == "fsync"}
    written = {p.name for p in final.rglob("*")}
    assert written and written <= synced_before  # every file, and the folder itself
    assert any(name.startswith(".tmp-checkpoint-3-") for name in synced_before)
    synced_after = [path for kind, path in events[publish:] if kind == "fsync"]
    assert str(final.parent) in synced_after  # the rename itself is made durable


def test_a_failed_save_leaves_the_previous_checkpoint_valid(tmp_path, monkeypatch):
    engine = TrainingEngine(engine_config(checkpoint_dir=str(tmp_path)))
    train(engine, 1, first_seed=0)
    engine.save_checkpoint()
    good = weights(engine)
    train(engine, 1, first_seed=1)

    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if str(path).endswith("rng_state.pt"):
            raise OSError("No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    with pytest.raises(OSError, match="No space"):
        engine.save_checkpoint()
    monkeypatch.undo()

    job = tmp_path / "default"
    assert sorted(p.name for p in job.iterdir()) == ["checkpoint-1", "latest"]
    assert (job / "latest").read_text() == "1"
    fresh = TrainingEngine(engine_config(checkpoint_dir=str(tmp_path)))
    assert fresh.load_checkpoint()["global_step"] == 1
    now = weights(fresh)
    assert all(torch.equal(now[n], good[n]) for n in good)


def test_latest_pointing_nowhere_falls_back_to_the_newest(tmp_path):
    engine = TrainingEngine(engine_config(checkpoint_dir=str(tmp_path)))
    engine.save_checkpoint(step=3)
    engine.save_checkpoint(step=5)
    (tmp_path / "default" / "latest").write_text("8")
    assert engine.load_checkpoint()["checkpoint_id"] == "checkpoint-5"
    assert engine.load_checkpoint(step=3)["checkpoint_id"] == "checkpoint-3"


def test_loading_a_checkpoint_that_does_not_fit_changes_nothing(tmp_path):
    lora = TrainingEngine(engine_config(model=LORA))
    saved = lora.save_checkpoint(tmp_path / "lora-job")
    engine = TrainingEngine(engine_config())
    train(engine, 1, first_seed=0)
    before = weights(engine)
    for path, step, field in [
        (saved["path"], None, "path"),
        (tmp_path / "empty", None, "path"),
        (tmp_path / "lora-job", 7, "step"),
    ]:
        with pytest.raises(EngineInputError) as info:
            engine.load_checkpoint(path, step=step)
        assert info.value.field == field
    assert engine.global_steps == 1
    assert all(torch.equal(weights(engine)[n], before[n]) for n in before)
    with pytest.raises(EngineInputError) as info:
        engine.save_checkpoint()  # no checkpoint_dir configured and no path given
    assert info.value.field == "path"


def test_lora_checkpoint_holds_the_adapter_and_an_optional_merged_export(tmp_path):
    engine = TrainingEngine(engine_config(model=LORA, optimizer={"lr": 1e-2}))
    train(engine, 2, first_seed=0)
    plain = engine.save_checkpoint(tmp_path / "job", step=2)
    assert plain["hf_path"] is None
    path = tmp_path / "job" / "checkpoint-2"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in path.iterdir()}
    assert not (path / "model.safetensors").exists()

    exported = engine.save_checkpoint(tmp_path / "job", step=2, export_hf=True)
    merged = AutoModelForCausalLM.from_pretrained(exported["hf_path"])
    ids = rl_batch(rows=1, seed=9)["input_ids"][:, 3:]
    engine.model.eval()
    with torch.no_grad():
        want = engine.model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
