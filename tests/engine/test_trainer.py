"""TrainingEngine: gradients independent of splitting, accumulation, validation, guard, LoRA."""

from __future__ import annotations

import math

import pytest
import torch

from arctic_platform.contract.problems import FieldError
from arctic_platform.engine import cancellation
from arctic_platform.engine.batching import plan_microbatches, validate_batch
from arctic_platform.engine.cancellation import CancelToken
from arctic_platform.engine.config import LoraConfig, ModelConfig
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.trainer import TrainingEngine
from tests.engine.rl_batches import TINY, engine_config, rl_batch, rows_of


def grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


def weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def optimizer_state(engine) -> list[dict]:
    state = engine.optimizer.state_dict()["state"]
    return [{k: v.clone() for k, v in s.items()} for _, s in sorted(state.items())]


def assert_all_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_all_close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **tol, msg=name)


@pytest.fixture(scope="module")
def batch():
    return rl_batch(rows=8, seed=11)


def reference_grads(batch) -> dict[str, torch.Tensor]:
    """verl_grpo defaults by hand: each row alone through the HF model, PPO clip, token mean."""
    model = load_causal_lm(TINY)
    model.train()
    mask_all = batch["response_mask"]
    total = torch.zeros(())
    for b in range(batch["input_ids"].shape[0]):
        cols = batch["attention_mask"][b].nonzero().squeeze(1)
        ids = batch["input_ids"][b, cols][None]
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
        for k in range(1, cols.numel()):
            col = cols[k]
            if not mask_all[b, col]:
                continue
            lp = logp[k - 1, ids[0, k]]
            adv = batch["advantages"][b, col]
            ratio = torch.exp(lp - batch["old_log_probs"][b, col])
            clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
            pg = torch.minimum(-adv * 3.0, clipped) if adv < 0 else clipped
            total = total + pg
    (total / mask_all.sum()).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_packed_microbatched_gradients_equal_one_unpacked_pass(batch):
    packed = TrainingEngine(engine_config(max_tokens_per_microbatch=24))
    padded = TrainingEngine(engine_config(packing=False, max_tokens_per_microbatch=100_000))
    parsed = validate_batch(batch)
    plan = plan_microbatches(parsed, parsed.input_ids, max_tokens=24, packing=True)
    assert len(plan) >= 3 and all(mb.packed for mb in plan)

    out_packed = packed.forward_backward(batch)
    out_padded = padded.forward_backward(batch)
    assert_all_close(grads(packed), grads(padded), rtol=1e-5, atol=1e-7)
    assert_all_close(grads(packed), reference_grads(batch), rtol=1e-5, atol=1e-7)
    for name, value in out_padded["metrics"].items():
        assert out_packed["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert out_packed["avg_loss"] == out_packed["loss"] == out_packed["metrics"]["loss"]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_two_calls_then_step_equal_one_call_then_step(batch, mode):
    split = TrainingEngine(engine_config(max_tokens_per_microbatch=40))
    whole = TrainingEngine(engine_config())
    meta = {
        "batch_num_tokens": batch["response_mask"].sum(),
        "global_batch_size": 8,
        "actor_config": {"loss_agg_mode": mode},
    }
    first = split.forward_backward(rows_of(batch, slice(0, 3)), meta)
    second = split.forward_backward(rows_of(batch, slice(3, 8)), meta)
    together = whole.forward_backward(batch, meta)
    assert_all_close(grads(split), grads(whole), rtol=1e-5, atol=1e-7)
    raw = {k: first["metric_sums"][k] + second["metric_sums"][k] for k in first["metric_sums"]}
    assert raw["loss.tokens"] == together["metric_sums"]["loss.tokens"]
    assert raw["loss.sum"] == pytest.approx(together["metric_sums"]["loss.sum"], rel=1e-5)
    split.step()
    whole.step()
    # Adam divides by |g|, so gradients near zero that agree to 1e-7 may move a weight by a few
    # percent of lr (1e-5) differently; 1e-7 is 1% of one step.
    assert_all_close(weights(split), weights(whole), rtol=1e-5, atol=1e-7)


def test_forward_output_is_usable_as_old_log_probs(batch):
    engine = TrainingEngine(engine_config(max_tokens_per_microbatch=30))
    on_policy = dict(batch, old_log_probs=engine.forward(batch)["logprobs"])
    metrics = engine.forward_backward(on_policy)["metrics"]
    assert abs(metrics["actor/ppo_kl"]) < 1e-6
    assert metrics["actor/pg_clipfrac"] == 0.0


def test_step_reports_and_counts(batch):
    engine = TrainingEngine(engine_config())
    engine.forward_backward(batch)
    before = weights(engine)
    result = engine.step()
    assert result["global_steps"] == 1
    assert result["metrics"] == {
        "grad_norm": result["grad_norm"],
        "last_lr": result["last_lr"],
        "skipped": 0,
    }
    assert result["last_lr"] == pytest.approx(1e-5)
    assert math.isfinite(result["grad_norm"]) and result["grad_norm"] > 0
    assert not all(torch.equal(before[n], w) for n, w in weights(engine).items())
    assert all(p.grad is None for p in engine.model.parameters())
    engine.forward_backward(batch)
    assert engine.step(learning_rate=3e-4)["last_lr"] == pytest.approx(3e-4)
    engine.forward_backward(batch)
    assert engine.step()["last_lr"] == pytest.approx(3e-4)  # the override persists


def test_grad_norm_is_the_pre_clip_norm_and_clipping_applies(batch):
    clipped = TrainingEngine(engine_config(optimizer={"grad_clip": 1e-4, "lr": 1e-2}))
    clipped.forward_backward(batch)
    norm = torch.nn.utils.get_total_norm([g for g in grads(clipped).values()])
    assert clipped.step()["grad_norm"] == pytest.approx(float(norm), rel=1e-6)


def test_step_adam_settings_match_torch_adamw(batch):
    """Tinker's per-step AdamParams: betas, eps, decay and clipping as torch's AdamW."""
    from arctic_platform.engine.trainer import AdamSettings

    engine = TrainingEngine(engine_config())
    reference = load_causal_lm(TINY)
    reference.load_state_dict(engine.model.state_dict())
    adam = AdamSettings(betas=(0.5, 0.7), eps=1e-3, weight_decay=0.1, grad_clip=0.05)
    ref_opt = torch.optim.AdamW(
        reference.parameters(), lr=2e-3, betas=(0.5, 0.7), eps=1e-3, weight_decay=0.1
    )
    for _ in range(2):
        engine.forward_backward(batch)
        for name, param in reference.named_parameters():
            param.grad = dict(engine.model.named_parameters())[name].grad.clone()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        engine.step(2e-3, adam=adam)
        ref_opt.step()
    want = {n: p.detach() for n, p in reference.named_parameters()}
    assert_all_close(weights(engine), want, rtol=1e-5, atol=1e-7)


def test_same_seed_same_calls_bitwise_equal_weights(batch):
    lora = ModelConfig(name="builtin:tiny", lora=LoraConfig(r=4, dropout=0.1))
    for model in (TINY, lora):
        runs = []
        for _ in range(2):
            engine = TrainingEngine(engine_config(model=model, max_tokens_per_microbatch=30))
            for _ in range(2):
                engine.forward_backward(batch)
                engine.step()
            runs.append(weights(engine))
        assert_all_equal(*runs)


def test_non_finite_gradient_skips_the_update(batch):
    engine = TrainingEngine(engine_config())
    engine.forward_backward(batch)
    engine.step()
    before, state = weights(engine), optimizer_state(engine)
    epoch = engine.scheduler.last_epoch
    poisoned = dict(batch, advantages=batch["advantages"].sign() * 3e38)  # finite, but overflows
    engine.forward_backward(poisoned)
    result = engine.step()
    assert not math.isfinite(result["grad_norm"])
    assert result["metrics"]["skipped"] == 1
    assert result["global_steps"] == 1
    assert_all_equal(weights(engine), before)
    assert all(
        torch.equal(a[k], b[k])
        for a, b in zip(optimizer_state(engine), state, strict=True)
        for k in a
    )
    assert engine.scheduler.last_epoch == epoch
    assert all(p.grad is None for p in engine.model.parameters())
    engine.forward_backward(batch)
    assert engine.step()["metrics"]["skipped"] == 0


def test_lora_trains_only_the_adapters(batch):
    model = ModelConfig(name="builtin:tiny", lora=LoraConfig(r=4, alpha=8))
    engine = TrainingEngine(engine_config(model=model, optimizer={"lr": 1e-2}))
    before = weights(engine)
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    optimized = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in engine.model.named_parameters() if n in trainable}
    for _ in range(2):
        engine.forward_backward(batch)
        engine.step()
    after = weights(engine)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    assert any(not torch.equal(before[n], after[n]) for n in trainable)


def test_cross_entropy_matches_hf_loss_and_gradients():
    g = torch.Generator().manual_seed(3)
    lengths = [12, 5, 9, 16]
    input_ids = torch.zeros(4, 16, dtype=torch.long)
    attention_mask = torch.zeros(4, 16, dtype=torch.long)
    for b, n in enumerate(lengths):
        input_ids[b, :n] = torch.randint(5, 100, (n,), generator=g)
        attention_mask[b, :n] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[1, 2] = -100
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    engine = TrainingEngine(engine_config(max_tokens_per_microbatch=20))
    out = engine.forward_backward(batch)  # default loss for a labels batch: cross_entropy
    reference = load_causal_lm(TINY).train()
    want = reference(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    want.backward()
    assert out["loss"] == pytest.approx(want.item(), rel=1e-5)
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert_all_close(grads(engine), ref_grads, rtol=1e-5, atol=1e-7)


def test_sleep_and_wake_on_cpu_say_there_is_nothing_to_offload(batch):
    engine = TrainingEngine(engine_config())
    assert engine.wake() == {"offloaded": False, "reason": "model is on cpu"}
    assert engine.sleep() == {"offloaded": False, "reason": "model is on cpu"}
    assert engine.sleep("all")["offloaded"] is False
    assert engine.empty_cache()["emptied"] is False
    engine.forward_backward(batch)  # still usable in any order
    with pytest.raises(EngineInputError) as info:
        engine.sleep("lp_params")
    assert info.value.field == "mode"


# -- bad input changes nothing --------------------------------------------------------------


def _bad_cases(batch):
    def edit(**changes):
        return {**batch, **changes}

    missing = {k: v for k, v in batch.items() if k != "advantages"}
    no_mask = {k: v for k, v in batch.items() if k != "attention_mask"}
    nan_adv = batch["advantages"].clone()
    nan_adv[0, 7] = math.nan
    pad_mask = batch["response_mask"].clone()
    pad_mask[0, 0] = 1
    big_ids = batch["input_ids"].clone()
    big_ids[2, 8] = 5000
    two = batch["attention_mask"].clone()
    two[0, 7] = 2
    return [
        ("batch.advantages", missing, None, None),
        ("batch.attention_mask", no_mask, None, None),
        ("batch.old_log_probs", edit(old_log_probs=batch["old_log_probs"][:, 1:]), None, None),
        ("batch.input_ids", edit(input_ids=batch["input_ids"].float()), None, None),
        ("batch.attention_mask", edit(attention_mask=two), None, None),
        ("batch.advantages", edit(advantages=nan_adv), None, None),
        ("batch.response_mask", edit(response_mask=pad_mask), None, None),
        ("batch.input_ids", edit(input_ids=big_ids), None, None),
        ("batch.responses", edit(responses=batch["responses"][:, 1:]), None, None),
        ("batch", [batch], None, None),
        ("processing.loss_fn", batch, None, {"loss_fn": "no_such_loss"}),
        ("processing.loss_fn", batch, None, {"loss_fn": None}),
        ("processing.post[1]", batch, None, {"post": ["apply_temperature", "softmax"]}),
        ("processing.extra", batch, None, {"extra": 1}),
        ("meta", batch, [1], None),
        ("meta.temperature", batch, {"temperature": 0}, None),
        ("meta.actor_config.clip_ratio", batch, {"actor_config": {"clip_ratio": "x"}}, None),
        ("meta.actor_config.loss_agg_mode", batch, {"actor_config": {"loss_agg_mode": "x"}}, None),
    ]


def test_bad_input_names_the_field_and_changes_no_state(batch):
    engine = TrainingEngine(engine_config(max_tokens_per_microbatch=30))
    engine.forward_backward(batch)
    engine.step()
    engine.forward_backward(batch)  # accumulated gradients must survive a rejected call
    state = (weights(engine), grads(engine), optimizer_state(engine), engine.global_steps)
    for field, bad_batch, meta, processing in _bad_cases(batch):
        with pytest.raises(FieldError) as info:
            engine.forward_backward(bad_batch, meta, processing)
        assert info.value.field == field, (field, str(info.value))
        assert field in str(info.value)
    with pytest.raises(EngineInputError) as info:
        engine.step(learning_rate=-1.0)
    assert info.value.field == "learning_rate"
    with pytest.raises(EngineInputError):
        engine.forward({**batch, "input_ids": batch["input_ids"][:, :3]})
    assert_all_equal(weights(engine), state[0])
    assert_all_equal(grads(engine), state[1])
    for a, b in zip(optimizer_state(engine), state[2], strict=True):
        assert_all_equal(a, b)
    assert engine.global_steps == state[3]


class _CancelAfterChecks(CancelToken):
    """A cancel token that reads as cancelled from its ``after``-th check on: it stops an op at
    a chosen microbatch boundary, as a ``cancel-request`` arriving mid-op would."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.reason = "request cancelled"
        self._left = after

    @property
    def cancelled(self) -> bool:
        self._left -= 1
        return self._left < 0


def test_a_forward_backward_stopped_between_microbatches_adds_no_gradient(batch):
    engine = TrainingEngine(engine_config(max_tokens_per_microbatch=30))
    meta = {"batch_num_tokens": batch["response_mask"].sum(), "global_batch_size": 8}
    engine.forward_backward(rows_of(batch, slice(0, 3)), meta)
    accumulated = grads(engine)
    later = rows_of(batch, slice(3, 8))
    with cancellation.scope(_CancelAfterChecks(2)), pytest.raises(cancellation.OpCancelled):
        engine.forward_backward(later, meta)  # two microbatches ran backward, then it stopped
    assert_all_equal(grads(engine), accumulated)
    # The job goes on as if the stopped call never happened: the same call again accumulates
    # what an engine that never saw the stopped call accumulates.
    engine.forward_backward(later, meta)
    uninterrupted = TrainingEngine(engine_config(max_tokens_per_microbatch=30))
    uninterrupted.forward_backward(rows_of(batch, slice(0, 3)), meta)
    uninterrupted.forward_backward(later, meta)
    assert_all_equal(grads(engine), grads(uninterrupted))
