"""The on-policy form of the policy losses: old log-probs omitted, or asked for as "current".

The reference is what a client does without it: ``fwd_no_grad`` just before the update, its
log-probs sent as ``old_log_probs``. Both must give the same loss, metrics and gradients.
"""

from __future__ import annotations

import pytest
import torch

from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.trainer import TrainingEngine
from tests.engine.rl_batches import engine_config, rl_batch

LOSSES = [
    ("verl_grpo", {}, {"actor_config": {"loss_agg_mode": "token-mean"}}),
    (
        "verl_grpo",
        {},
        {"actor_config": {"loss_agg_mode": "seq-mean-token-mean", "clip_ratio": 0.1}},
    ),
    ("ppo", {"loss_agg_mode": "token-mean"}, {}),
    ("importance_sampling", {}, {}),
]


def grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("loss", "config", "meta"), LOSSES, ids=lambda v: str(v)[:30])
@pytest.mark.parametrize("form", ["omitted", "current"])
def test_on_policy_form_equals_a_separate_logprob_pass(loss, config, meta, form):
    batch = rl_batch(rows=6, seed=5)
    separate = TrainingEngine(engine_config())
    old = separate.forward(batch)["logprobs"] * batch["response_mask"]
    want = separate.forward_backward(
        {**batch, "old_log_probs": old}, meta, {"loss_fn": loss, "config": config}
    )
    on_policy = TrainingEngine(engine_config())
    if form == "omitted":
        sent = {k: v for k, v in batch.items() if k != "old_log_probs"}
        processing = {"loss_fn": loss, "config": config}
    else:  # the batch's (stale) old log-probs are ignored
        sent = batch
        processing = {"loss_fn": loss, "config": {**config, "old_log_probs": "current"}}
    got = on_policy.forward_backward(sent, meta, processing)
    assert got["metrics"].keys() == want["metrics"].keys()
    for name, value in want["metrics"].items():
        assert got["metrics"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    assert got["metrics"]["actor/ppo_kl"] == 0.0
    mine, theirs = grads(on_policy), grads(separate)
    assert mine.keys() == theirs.keys()
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-8, msg=name)


def test_an_unknown_old_log_probs_source_is_refused_naming_the_field():
    engine = TrainingEngine(engine_config())
    with pytest.raises(EngineInputError, match="processing.config.old_log_probs"):
        engine.forward_backward(
            rl_batch(rows=2), None, {"loss_fn": "verl_grpo", "config": {"old_log_probs": "prev"}}
        )
    assert all(p.grad is None for p in engine.model.parameters())
