"""Prompt sharing: each distinct prompt runs once, and nothing a caller sees changes.

Every test scores the same batch with ``prompt_sharing: auto`` (checking that the plan really
shares) and against an independent reference: the rows one by one through the HF model, or the
engine with sharing ``off`` (today's path, itself checked against hand-written losses in
``test_trainer.py``). Batches mix prompts sampled several times with prompts sampled once, with
ragged prompt and response lengths, left-padded prompts and right-padded responses.
"""

from __future__ import annotations

import pytest
import torch

from arctic_platform.engine.batching import plan_microbatches, validate_batch
from arctic_platform.engine.config import LoraConfig, ModelConfig, SamplingEngineConfig
from arctic_platform.engine.forward import prepare_training_request
from arctic_platform.engine.logprob_engine import LogProbEngine
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.prompt_sharing import SAVED_METRIC, SharedMicroBatch
from arctic_platform.engine.trainer import TrainingEngine
from tests.engine.rl_batches import (
    GROUPS,
    TINY,
    engine_config,
    reference_logprobs,
    saved_prompt_tokens,
)
from tests.engine.rl_batches import shared_prompt_batch as shared_batch


def grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


def assert_close_dicts(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **tol, msg=name)


def kinds(engine: TrainingEngine, batch) -> list[str]:
    request = prepare_training_request(
        batch, None, None, engine.config, model=engine, backward=False
    )
    return [type(mb).__name__ for mb in request.plan]


@pytest.fixture(scope="module")
def batch():
    return shared_batch()


def test_logprobs_and_entropy_equal_each_row_alone(batch):
    engine = TrainingEngine(engine_config(max_tokens_per_microbatch=120))
    assert "SharedMicroBatch" in kinds(engine, batch)
    out = engine.forward(batch, {"calculate_entropy": True, "temperature": 0.7})
    model = load_causal_lm(TINY).eval()
    with torch.no_grad():
        logprobs, entropy = reference_logprobs(
            model,
            torch.as_tensor(batch["input_ids"]),
            torch.as_tensor(batch["attention_mask"]),
            temperature=0.7,
        )
    torch.testing.assert_close(out["logprobs"], logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["entropy"], entropy, rtol=1e-5, atol=1e-5)


LOSSES = [
    ("verl_grpo", {"actor_config": {"loss_agg_mode": "token-mean"}}),
    ("verl_grpo", {"actor_config": {"loss_agg_mode": "seq-mean-token-mean"}}),
    ("verl_grpo", {"actor_config": {"loss_agg_mode": "seq-mean-token-sum-norm"}}),
    (
        "verl_grpo",
        {"actor_config": {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coeff": 0.01}},
    ),
    ("ppo", {}),
    ("cross_entropy", {}),
]


@pytest.mark.parametrize(("loss", "meta"), LOSSES, ids=lambda v: str(v)[:40])
def test_loss_metrics_and_every_gradient_equal_the_unshared_pass(batch, loss, meta):
    shared = TrainingEngine(engine_config(max_tokens_per_microbatch=150))
    naive = TrainingEngine(engine_config(max_tokens_per_microbatch=150, prompt_sharing="off"))
    assert "SharedMicroBatch" in kinds(shared, batch)
    assert "SharedMicroBatch" not in kinds(naive, batch)
    processing = {"loss_fn": loss}
    out = shared.forward_backward(batch, meta, processing)
    ref = naive.forward_backward(batch, meta, processing)
    assert_close_dicts(grads(shared), grads(naive), rtol=1e-4, atol=1e-7)
    for name, value in ref["metrics"].items():
        if name != SAVED_METRIC:
            assert out["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_saved_prompt_tokens_are_reported(batch):
    engine = TrainingEngine(engine_config())
    out = engine.forward_backward(batch)
    saved = saved_prompt_tokens(GROUPS)
    tokens = int(batch["attention_mask"].sum())
    assert out["metric_sums"][f"{SAVED_METRIC}.sum"] == saved
    assert out["metric_sums"][f"{SAVED_METRIC}.tokens"] == tokens
    assert out["metrics"][SAVED_METRIC] == pytest.approx(saved / tokens)
    off = TrainingEngine(engine_config(prompt_sharing="off")).forward_backward(batch)
    assert off["metrics"][SAVED_METRIC] == 0.0


def test_a_small_token_budget_never_splits_a_group(batch):
    engine = TrainingEngine(engine_config(max_tokens_per_microbatch=30))
    request = prepare_training_request(
        batch, None, None, engine.config, model=engine, backward=True
    )
    prompts = [tuple(row[row != 0]) for row in batch["prompts"]]
    shared = [mb for mb in request.plan if isinstance(mb, SharedMicroBatch)]
    assert len(shared) >= 3  # the budget forces one group per microbatch
    seen = set()
    for mb in shared:
        groups = {prompts[i] for i in mb.rows.tolist()}
        rows_of_groups = [i for i, p in enumerate(prompts) if p in groups]
        assert sorted(mb.rows.tolist()) == rows_of_groups
        assert not groups & seen
        seen |= groups
    naive = TrainingEngine(engine_config(prompt_sharing="off"))
    engine.forward_backward(batch)
    naive.forward_backward(batch)
    assert_close_dicts(grads(engine), grads(naive), rtol=1e-4, atol=1e-7)


def test_gradients_accumulate_across_calls(batch):
    """Two fwd_bwd calls on halves, then step: the same weights as one unshared call."""
    meta = {"batch_num_tokens": batch["response_mask"].sum(), "global_batch_size": 16}
    halves = [{k: v[:8] for k, v in batch.items()}, {k: v[8:] for k, v in batch.items()}]
    split = TrainingEngine(engine_config(optimizer={"lr": 1e-3}))
    whole = TrainingEngine(engine_config(optimizer={"lr": 1e-3}, prompt_sharing="off"))
    assert any("SharedMicroBatch" in kinds(split, half) for half in halves)
    for half in halves:
        split.forward_backward(half, meta)
    whole.forward_backward(batch, meta)
    assert_close_dicts(grads(split), grads(whole), rtol=1e-4, atol=1e-7)


def test_lora_gradients_equal_the_unshared_pass(batch):
    model = ModelConfig(name="builtin:tiny", lora=LoraConfig(r=4, alpha=8))
    shared = TrainingEngine(engine_config(model=model))
    naive = TrainingEngine(engine_config(model=model, prompt_sharing="off"))
    assert "SharedMicroBatch" in kinds(shared, batch)
    shared.forward_backward(batch)
    naive.forward_backward(batch)
    lora = grads(shared)
    assert lora and all("lora_" in name for name in lora)
    assert_close_dicts(lora, grads(naive), rtol=1e-4, atol=1e-7)


def test_reference_model_logprobs_equal_the_unshared_pass(batch):
    config = SamplingEngineConfig(model=TINY)
    shared = LogProbEngine(config).forward(batch)
    naive = LogProbEngine(config.model_copy(update={"prompt_sharing": "off"})).forward(batch)
    torch.testing.assert_close(shared["logprobs"], naive["logprobs"], rtol=1e-5, atol=1e-5)
    assert shared["metrics"][SAVED_METRIC] > 0


def test_knob_off_is_todays_plan_bit_for_bit(batch):
    engine = TrainingEngine(engine_config(max_tokens_per_microbatch=60, prompt_sharing="off"))
    request = prepare_training_request(
        batch, None, None, engine.config, model=engine, backward=True
    )
    parsed = validate_batch(batch)
    today = plan_microbatches(parsed, parsed.input_ids, max_tokens=60, packing=True)
    assert len(request.plan) == len(today)
    for mine, theirs in zip(request.plan, today, strict=True):
        assert type(mine) is type(theirs)
        for name, value in vars(theirs).items():
            other = getattr(mine, name)
            assert (value is None and other is None) or torch.equal(other, value), name


def test_auto_does_not_share_when_it_saves_little():
    short_prompts = shared_batch(groups=[(2, 3), (2, 2), (3, 3)])
    engine = TrainingEngine(engine_config())
    assert "SharedMicroBatch" not in kinds(engine, short_prompts)


def test_gradient_checkpointing_turns_sharing_off(batch):
    engine = TrainingEngine(engine_config(gradient_checkpointing=True))
    assert "SharedMicroBatch" not in kinds(engine, batch)


def test_rows_share_by_response_mask_without_prompts_field(batch):
    """Without verl's ``prompts``, a row's prompt is what precedes its response_mask."""
    bare = {k: v for k, v in batch.items() if k not in ("prompts", "responses")}
    engine = TrainingEngine(engine_config())
    assert "SharedMicroBatch" in kinds(engine, bare)
    naive = TrainingEngine(engine_config(prompt_sharing="off"))
    torch.testing.assert_close(
        engine.forward(bare)["logprobs"], naive.forward(bare)["logprobs"], rtol=1e-5, atol=1e-5
    )


def test_resume_from_a_checkpoint_continues_the_shared_run(batch, tmp_path):
    """Sharing keeps no state outside the model and optimizer: a shared run saved after one step
    and resumed in a fresh engine ends bit for bit where the uninterrupted shared run does, and
    within AdamW's rounding amplification of the unshared run (an element with a near-zero
    gradient turns fp32 rounding into up to a step of ``lr``)."""

    def train(sharing: str, *, restart: bool) -> dict[str, torch.Tensor]:
        engine = TrainingEngine(engine_config(optimizer={"lr": 1e-3}, prompt_sharing=sharing))
        engine.forward_backward(batch)
        engine.step()
        if restart:
            saved = engine.save_checkpoint(tmp_path / sharing)
            engine = TrainingEngine(engine_config(optimizer={"lr": 1e-3}, prompt_sharing=sharing))
            engine.load_checkpoint(saved["path"])
        assert sharing == "off" or "SharedMicroBatch" in kinds(engine, batch)
        engine.forward_backward(batch)
        engine.step()
        return {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    resumed, uninterrupted = train("auto", restart=True), train("auto", restart=False)
    naive = train("off", restart=False)
    initial = dict(load_causal_lm(TINY).named_parameters())
    assert any(not torch.equal(naive[n], initial[n]) for n in naive)  # the steps moved weights
    for name, want in uninterrupted.items():
        assert torch.equal(resumed[name], want), name
    assert_close_dicts(resumed, naive, rtol=0, atol=2e-5)
