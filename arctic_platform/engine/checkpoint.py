"""Resumable checkpoints: ``<job_dir>/checkpoint-<step>/``, written atomically.

A checkpoint directory holds

* the model in HF layout (``config.json`` + safetensors, and the tokenizer when the model has one),
  so ``from_pretrained(<dir>)`` loads it; for LoRA, the peft adapter instead
  (``PeftModel.from_pretrained`` loads it) and, with ``export_hf``, a merged full model in ``hf/``;
* ``optimizer.pt`` and ``scheduler.pt`` (torch state dicts, loaded with ``weights_only=True``);
* ``rng_state.pt`` (torch CPU and CUDA generators, Python ``random``, numpy);
* ``trainer_state.json`` (global step, learning-rate override).

Writes go to a hidden staging directory in the job folder, are fsynced and renamed into place
(:mod:`arctic_platform.engine.checkpoint_staging`; a save over the same step keeps the old folder
until the new one is in place), then the ``latest`` pointer file (holding the step, as the
reference server writes it) is replaced atomically. A save that fails half-way leaves the
previous checkpoints and ``latest`` as they were, and raises a filesystem error as
:class:`~arctic_platform.engine.errors.CheckpointWriteError`. A checkpoint that is missing or
incomplete is :class:`~arctic_platform.engine.errors.CheckpointNotFound`. ``save_total_limit``
keeps the newest ``checkpoint-<step>`` folders of the job and deletes older ones; nothing else in
the folder is touched (the trainer applies it only to the job's own checkpoint folder).

Restoring every piece of state is what makes resumption bitwise-identical to an uninterrupted run
on CPU.
"""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from arctic_platform.engine import checkpoint_staging as staging_files
from arctic_platform.engine.checkpoint_layout import (
    ADAPTER_WEIGHTS,
    HF_EXPORT_DIR,
    LATEST_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE,
    checkpoint_id,
    prune_checkpoints,
)
from arctic_platform.engine.errors import CheckpointNotFound, EngineInputError


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (its checkpoint holds only the adapter)."""
    return hasattr(model, "peft_config")


def save_checkpoint(
    job_dir: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer_state: dict[str, Any],
    tokenizer=None,
    export_hf: bool = False,
    save_total_limit: int | None = None,
) -> dict[str, Any]:
    """Write ``<job_dir>/checkpoint-<step>`` atomically, point ``latest`` at it, apply retention.

    Returns ``{"path", "global_step", "checkpoint_id", "hf_path"}`` (``hf_path``: where a
    ``from_pretrained``-loadable full model is; None for LoRA without ``export_hf``).
    """
    job = Path(job_dir)
    name = checkpoint_id(step)
    final = job / name
    with staging_files.staged(final) as staging:
        _write_model(staging, model, tokenizer, export_hf=export_hf)
        torch.save(optimizer.state_dict(), staging / OPTIMIZER_FILE)
        torch.save(scheduler.state_dict(), staging / SCHEDULER_FILE)
        torch.save(capture_rng(), staging / RNG_FILE)
        (staging / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2))
    with staging_files.writing():
        staging_files.write_text_atomic(job / LATEST_FILE, str(step))
        if save_total_limit:
            prune_checkpoints(job, save_total_limit, keep_name=name)
    hf_path = None
    if not is_lora(model):
        hf_path = str(final)
    elif export_hf:
        hf_path = str(final / HF_EXPORT_DIR)
    return {"path": str(final), "global_step": step, "checkpoint_id": name, "hf_path": hf_path}


def load_checkpoint(
    directory: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG state from ``directory``; return trainer state.

    Every file is read and checked against the live objects before anything is changed, so a
    checkpoint that does not fit (another model, a missing file) leaves the engine as it was.
    """
    for required in (TRAINER_STATE, OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE):
        if not (directory / required).is_file():
            raise CheckpointNotFound(
                "path", f"{directory} is not a complete checkpoint ({required} missing)"
            )
    weights = _read_model_weights(directory, model)
    optimizer_state = torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    scheduler_state = torch.load(directory / SCHEDULER_FILE, map_location="cpu", weights_only=True)
    rng_state = torch.load(directory / RNG_FILE, map_location="cpu", weights_only=True)
    trainer_state = json.loads((directory / TRAINER_STATE).read_text())
    _check_optimizer_state(optimizer, optimizer_state, directory)

    with torch.no_grad():
        if is_lora(model):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, weights)
        else:
            model.load_state_dict(weights, strict=False)
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    restore_rng(rng_state)
    return trainer_state


def capture_rng() -> dict[str, Any]:
    """Every random generator a training step may draw from."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _to_lists(random.getstate()),
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- internals ------------------------------------------------------------------------------


def _write_model(directory: Path, model: torch.nn.Module, tokenizer, *, export_hf: bool) -> None:
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if is_lora(model) and export_hf:
        merged = copy.deepcopy(model).merge_and_unload()
        merged.save_pretrained(directory / HF_EXPORT_DIR)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory / HF_EXPORT_DIR)


def _read_model_weights(directory: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The saved weights, checked to fit ``model`` (names and shapes)."""
    if is_lora(model):
        path = directory / ADAPTER_WEIGHTS
        if not path.is_file():
            raise CheckpointNotFound(
                "path", f"{directory} holds no LoRA adapter ({ADAPTER_WEIGHTS})"
            )
        from peft import get_peft_model_state_dict

        weights = load_file(path)
        expected = get_peft_model_state_dict(model)
        if set(weights) != set(expected) or any(
            weights[k].shape != expected[k].shape for k in weights
        ):
            raise EngineInputError(
                "path", f"the LoRA adapter in {directory} does not fit the model"
            )
        return weights
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFound("path", f"{directory} holds no model weights (*.safetensors)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    live = model.state_dict()
    unexpected = sorted(set(weights) - set(live))
    wrong = sorted(k for k in weights if k in live and weights[k].shape != live[k].shape)
    if unexpected or wrong:
        raise EngineInputError(
            "path", f"checkpoint weights do not fit the model: {(unexpected + wrong)[:3]}"
        )
    loaded_storage = {live[k].data_ptr() for k in weights}
    missing = [k for k in live if k not in weights and live[k].data_ptr() not in loaded_storage]
    if missing:
        raise EngineInputError("path", f"checkpoint lacks weights for {missing[:3]}")
    return weights


def _check_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, directory: Path) -> None:
    saved = [len(g["params"]) for g in state.get("param_groups", [])]
    live = [len(g["params"]) for g in optimizer.param_groups]
    if saved != live:
        raise EngineInputError(
            "path", f"optimizer state in {directory} is for a different set of trainable weights"
        )


def _to_lists(value):
    return [_to_lists(v) for v in value] if isinstance(value, (tuple, list)) else value
