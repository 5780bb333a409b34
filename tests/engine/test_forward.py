"""``forward`` (fwd_no_grad): position-indexed log-probs equal a plain HF log_softmax gather."""

from __future__ import annotations

import pytest
import torch

from arctic_platform.engine.batching import plan_microbatches, validate_batch
from arctic_platform.engine.trainer import TrainingEngine
from tests.engine.rl_batches import engine_config, reference_logprobs, rl_batch


@pytest.fixture(scope="module")
def packed_engine():
    return TrainingEngine(engine_config(max_tokens_per_microbatch=24))


@pytest.fixture(scope="module")
def padded_engine():
    return TrainingEngine(engine_config(packing=False, max_tokens_per_microbatch=40))


def test_sdpa_packing_keeps_sequences_apart(packed_engine):
    """transformers builds a block-diagonal causal mask from restarting position ids."""
    model = packed_engine.model
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 100, (n,), generator=g) for n in (5, 11, 3, 8)]
    with torch.no_grad():
        alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]
        packed = model(
            input_ids=torch.cat(seqs)[None],
            position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None],
            attention_mask=None,
            use_cache=False,
        ).logits[0]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["packed_engine", "padded_engine"])
def test_forward_logprobs_equal_hf_log_softmax_gather(which, request):
    engine = request.getfixturevalue(which)
    batch = rl_batch(rows=7, seed=1)
    out = engine.forward(batch)
    with torch.no_grad():
        want, _ = reference_logprobs(engine.model, batch["input_ids"], batch["attention_mask"])
    assert out["logprobs"].dtype == torch.float32
    assert out["logprobs"].shape == batch["input_ids"].shape
    assert "entropy" not in out
    torch.testing.assert_close(out["logprobs"], want, rtol=1e-5, atol=1e-5)
    # Column 0, padding and every row's first token hold exactly 0.
    first = batch["attention_mask"].cumsum(1) == 1
    assert (out["logprobs"][(batch["attention_mask"] == 0) | first] == 0).all()


def test_entropy_and_temperature(packed_engine):
    batch = rl_batch(rows=5, seed=2)
    meta = {"temperature": 0.7}
    out = packed_engine.forward(batch, meta, {"config": {"calculate_entropy": True}})
    with torch.no_grad():
        want_lp, want_h = reference_logprobs(
            packed_engine.model, batch["input_ids"], batch["attention_mask"], temperature=0.7
        )
    torch.testing.assert_close(out["logprobs"], want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["entropy"], want_h, rtol=1e-5, atol=1e-5)


def test_entropy_requests(packed_engine):
    batch = rl_batch(rows=2, seed=3)
    post = {"post": ["compute_entropy_and_logprobs"]}
    assert "entropy" in packed_engine.forward(batch, None, post)
    assert "entropy" not in packed_engine.forward(batch, {"calculate_entropy": False}, post)
    assert "entropy" in packed_engine.forward(batch, {"calculate_entropy": True})
    # Without apply_temperature in the list, the temperature is not applied.
    plain = packed_engine.forward(batch)["logprobs"]
    untempered = packed_engine.forward(batch, {"temperature": 0.5}, post)["logprobs"]
    assert torch.equal(plain, untempered)


def test_numpy_batch_gives_the_same_answer(packed_engine):
    batch = rl_batch(rows=4, seed=4)
    as_numpy = {k: v.numpy() for k, v in batch.items()}
    as_numpy["input_ids"].setflags(write=False)  # as a wire decoder hands them over
    torch.testing.assert_close(
        packed_engine.forward(as_numpy)["logprobs"], packed_engine.forward(batch)["logprobs"]
    )


def test_mask_with_a_hole_scores_against_the_previous_real_token(packed_engine, padded_engine):
    batch = rl_batch(rows=3, seed=5, prompt_lengths=[5, 6, 7], response_lengths=[9, 8, 9])
    batch["attention_mask"][1, 9] = 0  # a hole inside row 1's response
    batch["response_mask"][1, 9] = 0
    with torch.no_grad():
        want, _ = reference_logprobs(
            packed_engine.model, batch["input_ids"], batch["attention_mask"]
        )
    for engine in (packed_engine, padded_engine):
        torch.testing.assert_close(engine.forward(batch)["logprobs"], want, rtol=1e-5, atol=1e-5)


def test_custom_position_ids_are_honoured(packed_engine):
    """Non-standard positions cannot be packed; the padded path passes them to the model."""
    batch = rl_batch(rows=3, seed=6)
    mask = batch["attention_mask"]
    batch["position_ids"] = ((mask.cumsum(1) - 1).clamp(min=0) + 3) * mask
    parsed = validate_batch(batch)
    assert not parsed.standard_positions
    plan = plan_microbatches(parsed, parsed.input_ids, max_tokens=24, packing=True)
    assert not any(mb.packed for mb in plan)
    out = packed_engine.forward(batch)["logprobs"]
    with torch.no_grad():
        for b in range(3):
            cols = mask[b].nonzero().squeeze(1)
            ids = batch["input_ids"][b, cols][None]
            logits = packed_engine.model(
                input_ids=ids, position_ids=batch["position_ids"][b, cols][None], use_cache=False
            ).logits[0]
            logp = torch.log_softmax(logits, -1)
            want = logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
            torch.testing.assert_close(out[b, cols[1:]], want, rtol=1e-5, atol=1e-5)


def test_microbatch_plans_respect_the_budget():
    batch = validate_batch(rl_batch(rows=9, seed=7))
    for packing in (True, False):
        plan = plan_microbatches(batch, batch.input_ids, max_tokens=20, packing=packing)
        covered = sorted(int(r) for mb in plan for r in mb.rows)
        assert covered == list(range(9))
        for mb in plan:
            assert mb.packed == packing
            assert mb.num_tokens <= 20 or mb.rows.numel() == 1
    long_row = plan_microbatches(batch, batch.input_ids, max_tokens=4, packing=True)
    assert all(mb.rows.numel() == 1 for mb in long_row)


def test_packed_rows_are_no_wider_than_the_longest_sequence_and_stack_when_full():
    lengths = [10, 3, 7, 6, 4, 9, 1]  # rows of width 10: [10], [9, 1], [7, 3], [6, 4]
    batch = validate_batch(
        rl_batch(
            rows=7,
            prompt_width=1,
            response_width=9,
            prompt_lengths=[1] * 7,
            response_lengths=[n - 1 for n in lengths],
        )
    )
    assert batch.lengths.tolist() == lengths
    plan = plan_microbatches(batch, batch.input_ids, max_tokens=30, packing=True)
    assert [tuple(mb.input_ids.shape) for mb in plan] == [(3, 10), (1, 10)]
    assert [sorted(mb.rows.tolist()) for mb in plan] == [[0, 1, 2, 5, 6], [3, 4]]
    # A wide budget stacks all four full rows; a tight one keeps them apart.
    assert [
        tuple(mb.input_ids.shape)
        for mb in plan_microbatches(batch, batch.input_ids, max_tokens=40, packing=True)
    ] == [(4, 10)]
    assert len(plan_microbatches(batch, batch.input_ids, max_tokens=10, packing=True)) == 4


def test_equal_lengths_are_not_packed():
    batch = rl_batch(rows=3, prompt_lengths=[7, 7, 7], response_lengths=[9, 9, 9])
    parsed = validate_batch(batch)
    plan = plan_microbatches(parsed, parsed.input_ids, max_tokens=10_000, packing=True)
    assert len(plan) == 1
    assert not plan[0].packed


def test_forward_with_a_loss_reports_its_metrics_without_training(packed_engine):
    batch = rl_batch(rows=4, seed=9)
    before = [p.detach().clone() for p in packed_engine.model.parameters()]
    out = packed_engine.forward(batch, None, {"loss_fn": "verl_grpo"})
    trained = TrainingEngine(engine_config(max_tokens_per_microbatch=24)).forward_backward(batch)
    assert out["avg_loss"] == out["loss"] == pytest.approx(trained["loss"], rel=1e-6)
    assert out["metrics"] == pytest.approx(trained["metrics"], rel=1e-6)
    assert all(p.grad is None for p in packed_engine.model.parameters())
    assert all(
        torch.equal(a, b) for a, b in zip(before, packed_engine.model.parameters(), strict=True)
    )


def test_bf16_model_scores_in_float32(packed_engine):
    bf16 = TrainingEngine(engine_config(model={"name": "builtin:tiny", "dtype": "bfloat16"}))
    batch = rl_batch(rows=3, seed=10)
    out = bf16.forward(batch, {"temperature": 0.9})
    assert out["logprobs"].dtype == torch.float32
    want = packed_engine.forward(batch, {"temperature": 0.9})["logprobs"]
    torch.testing.assert_close(out["logprobs"], want, rtol=0, atol=0.1)
    assert bf16.forward_backward(batch)["metrics"]["loss"] == pytest.approx(
        packed_engine.forward(batch, None, {"loss_fn": "verl_grpo"})["loss"], abs=0.05
    )
