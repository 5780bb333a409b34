"""Batch, meta and processing validation: conversions accepted, errors naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arctic_platform.contract.problems import FieldError
from arctic_platform.contract.processing import DEFAULT_POST, parse_processing
from arctic_platform.engine.batching import validate_batch
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.meta import parse_meta, parse_request
from tests.engine.rl_batches import rl_batch


def test_conversions():
    batch = rl_batch(rows=3, seed=0)
    as_numpy = {k: v.numpy() for k, v in batch.items()}
    as_numpy["attention_mask"] = as_numpy["attention_mask"].astype(bool)
    as_numpy["advantages"] = as_numpy["advantages"].astype(np.float64)
    parsed = validate_batch({**as_numpy, "uid": ["a", "b", "c"]})  # unknown keys are ignored
    assert parsed.input_ids.dtype == torch.long
    assert parsed.attention_mask.dtype == torch.bool
    assert parsed.get("advantages").dtype == torch.float32
    assert parsed.get("response_mask").dtype == torch.bool
    assert "uid" not in parsed.tensors
    assert parsed.standard_positions
    mask = batch["attention_mask"]
    want = (mask.cumsum(1) - 1).clamp(min=0)
    assert torch.equal(parsed.position_ids[mask.bool()], want[mask.bool()])


def test_bf16_arrays_from_the_wire_are_the_bf16_tensors_they_encode():
    """A DSSST1 frame decodes bf16 to ml_dtypes arrays, which ``torch.as_tensor`` refuses: the
    batch takes them as the same bf16 values, read-only (a frame's view) or not."""
    import ml_dtypes

    batch = rl_batch(rows=3, seed=0)
    want = batch["old_log_probs"].to(torch.bfloat16)
    as_numpy = {k: v.numpy() for k, v in batch.items()}
    as_numpy["old_log_probs"] = want.float().numpy().astype(ml_dtypes.bfloat16)
    as_numpy["old_log_probs"].flags.writeable = False
    parsed = validate_batch(as_numpy)
    assert parsed.get("old_log_probs").dtype == torch.float32  # the engine's float fields
    assert torch.equal(parsed.get("old_log_probs"), want.float())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda b: b.update(input_ids=b["input_ids"][0]), "batch.input_ids"),
        (lambda b: b.update(input_ids=-b["input_ids"]), "batch.input_ids"),
        (lambda b: b.update(position_ids=b["input_ids"][:, 1:]), "batch.position_ids"),
        (lambda b: b.update(position_ids=b["input_ids"].float()), "batch.position_ids"),
        (
            lambda b: b.update(attention_mask=torch.zeros_like(b["attention_mask"])),
            "batch.attention_mask",
        ),
        (lambda b: b.update(prompts=b["prompts"][:2]), "batch.prompts"),
        (lambda b: b.update(advantages=b["advantages"] > 0), "batch.advantages"),
        (lambda b: b.update(loss_mask=b["response_mask"] * 0.5), "batch.loss_mask"),
        (lambda b: b.update(labels=b["input_ids"]), "batch.labels"),  # labels on padding
        (lambda b: b.update(advantages="high"), "batch.advantages"),
    ],
)
def test_bad_fields(change, field):
    batch = rl_batch(rows=3, seed=1)
    change(batch)
    with pytest.raises(EngineInputError) as info:
        validate_batch(batch, vocab_size=128)
    assert info.value.field == field


def test_meta_accepts_wire_scalars_and_rejects_bad_types():
    meta = parse_meta(
        {
            "batch_num_tokens": torch.tensor(37),
            "global_batch_size": np.int64(8),
            "dp_size": 2,
            "temperature": np.float32(0.5),
            "rollout_n": 4,  # verl sends more keys than the engine reads
            "rollout_is_weights": None,
        }
    )
    assert (meta.batch_num_tokens, meta.global_batch_size, meta.dp_size) == (37.0, 8, 2)
    assert meta.temperature == 0.5
    for bad, field in [
        ({"dp_size": 1.5}, "meta.dp_size"),
        ({"dp_size": True}, "meta.dp_size"),
        ({"batch_num_tokens": torch.ones(2)}, "meta.batch_num_tokens"),
        ({"batch_num_tokens": 0}, "meta.batch_num_tokens"),
        ({"temperature": float("nan")}, "meta.temperature"),
        ({"calculate_entropy": "yes"}, "meta.calculate_entropy"),
        ({"actor_config": [1]}, "meta.actor_config"),
    ]:
        with pytest.raises(EngineInputError) as info:
            parse_meta(bad)
        assert info.value.field == field


def test_processing_defaults_and_errors():
    default = parse_processing(None, default_loss="verl_grpo")
    assert default.post == DEFAULT_POST and default.loss_fn == "verl_grpo"
    explicit = parse_processing(
        {"post": ["compute_entropy_and_logprobs"], "loss_fn": None}, default_loss="x"
    )
    assert explicit.loss_fn is None
    for bad, field in [
        ({"post": "apply_temperature"}, "processing.post"),
        ({"post": ["nope"]}, "processing.post[0]"),
        ({"post": [["apply_temperature"]]}, "processing.post[0]"),
        ({"loss_fn": 3}, "processing.loss_fn"),
        ({"loss_fn": "grpo_typo"}, "processing.loss_fn"),
        ({"config": [1]}, "processing.config"),
        ({"config": {"calculate_entropy": 1}}, "processing.config.calculate_entropy"),
    ]:
        with pytest.raises(FieldError) as info:
            parse_request(None, bad, default_loss=None)
        assert info.value.field == field


def test_the_contracts_processing_names_are_the_engines(monkeypatch):
    """The server checks names against the contract's registries (torch-free); the engine's code
    is registered under exactly those names, built-ins and any loss registered later alike."""
    from arctic_platform.contract.processing import LOSS_NAMES, POST_PROCESSOR_NAMES
    from arctic_platform.engine.losses import LOSSES, register_loss
    from arctic_platform.engine.postprocess import POST_PROCESSORS

    assert POST_PROCESSOR_NAMES.known() == sorted(POST_PROCESSORS)
    assert LOSS_NAMES.known() == sorted(LOSSES)
    with pytest.raises(FieldError, match="unknown loss 'my_test_loss'"):
        parse_processing({"loss_fn": "my_test_loss"}, default_loss=None)
    # registered for this test only: both registries are restored afterwards
    monkeypatch.setattr(LOSS_NAMES, "_names", set(LOSS_NAMES.known()))
    monkeypatch.setitem(LOSSES, "my_test_loss", None)
    register_loss("my_test_loss")(LOSSES["cross_entropy"])
    assert parse_processing({"loss_fn": "my_test_loss"}, default_loss=None).loss_fn
    assert LOSS_NAMES.known() == sorted(LOSSES)


@pytest.mark.parametrize(
    "meta, processing, wanted",
    [
        (None, None, None),
        ({"calculate_entropy": True}, None, True),
        ({"calculate_entropy": False}, {"post": ["compute_entropy_and_logprobs"]}, False),
        (None, {"post": ["compute_entropy_and_logprobs"]}, True),
        (None, {"post": ["compute_logprobs"]}, None),
        # processing.config's spelling wins over meta's
        ({"calculate_entropy": True}, {"config": {"calculate_entropy": False}}, False),
        (None, {"config": {"calculate_entropy": True}, "post": ["compute_logprobs"]}, True),
    ],
)
def test_entropy_spellings_fold_into_the_one_knob(meta, processing, wanted):
    folded, _ = parse_request(meta, processing, default_loss=None)
    assert folded.calculate_entropy is wanted
