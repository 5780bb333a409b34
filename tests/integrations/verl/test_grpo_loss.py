"""``verl_grpo`` against verl's own ``core_algos`` on the same tensors, every agg mode and KL type.

verl computes its actor loss on response-aligned ``[B, R]`` tensors: the vanilla policy loss
(``get_policy_loss_fn("vanilla")``, i.e. ``compute_policy_loss_vanilla``), minus
``entropy_coeff * agg_loss(entropy)``, plus ``kl_loss_coef * agg_loss(kl_penalty(...))``
(``verl/workers/utils/losses.py::ppo_loss``). Ours takes the same values position-indexed in the
``[B, P + R]`` wire layout; the loss, its gradients and the clip metrics must agree.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from arctic_platform.integrations.verl import grpo_loss

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

AGG_MODES = grpo_loss.AGG_MODES
KL_TYPES = grpo_loss.KL_TYPES
P, R, B = 3, 5, 4
KNOBS = {"clip_ratio": 0.2, "clip_ratio_low": 0.15, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
ENTROPY_COEFF, KL_COEF = 0.01, 0.05
DP, TOKENS, SEQS = 2, 23.0, 9  # global counts over two data-parallel workers


def response_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """verl's response-aligned tensors with ragged responses and ratios on both clip sides."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 4, 1])
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    logp = -torch.rand(B, R, generator=g) * 3
    return {
        "mask": mask,
        "log_prob": logp * mask,
        "old_log_prob": (logp + (torch.rand(B, R, generator=g) - 0.5) * 0.9) * mask,
        "advantages": torch.randn(B, 1, generator=g).expand(B, R) * mask,
        "ref_log_prob": (logp + torch.randn(B, R, generator=g) * 0.7) * mask,
        "entropy": torch.rand(B, R, generator=g) * 2 * mask,
        "weights": (0.5 + torch.rand(B, R, generator=g)) * mask,
    }


def position_indexed(value: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` response values at columns ``[P, P + R)`` of ``[B, P + R]`` (zeros before)."""
    return torch.cat([torch.zeros(B, P, dtype=value.dtype), value], dim=1)


def wire_batch(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 90, (B, P + R), generator=g)
    attention_mask = torch.cat([torch.ones(B, P), t["mask"]], dim=1).long()
    attention_mask[1, 0] = 0  # one left-padded prompt
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "prompts": input_ids[:, :P],
        "responses": input_ids[:, P:],
        "response_mask": position_indexed(t["mask"]).long(),
        "advantages": position_indexed(t["advantages"]),
        "old_log_probs": position_indexed(t["old_log_prob"]),
        "ref_log_prob": position_indexed(t["ref_log_prob"]),
        "rollout_is_weights": position_indexed(t["weights"]),
    }


def verl_loss(t, mode, kl_type, log_prob, entropy):
    """verl's actor loss assembled from core_algos, as verl's ppo_loss assembles it."""
    info = {"dp_size": DP, "batch_num_tokens": TOKENS, "global_batch_size": SEQS}
    info["loss_scale_factor"] = None
    config = OmegaConf.create({**KNOBS, "global_batch_info": info})
    mask = t["mask"].bool()
    pg_loss, metrics = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=t["old_log_prob"],
        log_prob=log_prob,
        advantages=t["advantages"],
        response_mask=mask,
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=t["weights"],
    )
    entropy_loss = core_algos.agg_loss(entropy, mask, mode, **info)
    kld = core_algos.kl_penalty(log_prob, t["ref_log_prob"], kl_type)
    kl_loss = core_algos.agg_loss(kld, mask, mode, **info)
    return pg_loss - ENTROPY_COEFF * entropy_loss + KL_COEF * kl_loss, metrics


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_loss_and_gradients_match_verl(mode, kl_type):
    t = response_tensors()
    log_prob = t["log_prob"].clone().requires_grad_()
    entropy = t["entropy"].clone().requires_grad_()
    want, want_metrics = verl_loss(t, mode, kl_type, log_prob, entropy)
    want.backward()

    ours_logp = position_indexed(t["log_prob"]).requires_grad_()
    ours_entropy = position_indexed(t["entropy"]).requires_grad_()
    actor_config = {
        **KNOBS,
        "loss_agg_mode": mode,
        "entropy_coeff": ENTROPY_COEFF,
        "use_kl_loss": True,
        "kl_loss_coef": KL_COEF,
        "kl_loss_type": kl_type,
    }
    meta = {
        "dp_size": DP,
        "batch_num_tokens": TOKENS,
        "global_batch_size": SEQS,
        "actor_config": actor_config,
    }
    loss, metrics = grpo_loss.verl_grpo_loss(
        {"logprobs": ours_logp, "entropy": ours_entropy}, wire_batch(t), meta, {}
    )
    loss.backward()

    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_logp.grad[:, P:], log_prob.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_entropy.grad[:, P:], entropy.grad, rtol=1e-5, atol=1e-6)
    assert ours_logp.grad[:, :P].abs().sum() == 0
    for name in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert metrics[name] == pytest.approx(want_metrics[name], rel=1e-5, abs=1e-6), name
    assert metrics["kl_coef"] == KL_COEF


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_verl(mode):
    t = response_tensors(seed=3)
    for kwargs in ({}, {"dp_size": DP, "batch_num_tokens": TOKENS, "global_batch_size": SEQS}):
        ours = grpo_loss.agg_loss(t["entropy"], t["mask"], mode, **kwargs)
        want = core_algos.agg_loss(t["entropy"], t["mask"], mode, **kwargs)
        torch.testing.assert_close(ours, want.to(ours.dtype), rtol=1e-6, atol=1e-7)
    scaled = grpo_loss.agg_loss(t["entropy"], t["mask"], mode, loss_scale_factor=7)
    want = core_algos.agg_loss(t["entropy"], t["mask"], mode, loss_scale_factor=7)
    torch.testing.assert_close(scaled, want.to(scaled.dtype), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_kl_penalty_matches_verl(kl_type):
    t = response_tensors(seed=5)
    ours_in = t["log_prob"].clone().requires_grad_()
    verl_in = t["log_prob"].clone().requires_grad_()
    ours = grpo_loss.kl_penalty(ours_in, t["ref_log_prob"], kl_type)
    want = core_algos.kl_penalty(verl_in, t["ref_log_prob"], kl_type)
    torch.testing.assert_close(ours, want)
    ours.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(ours_in.grad, verl_in.grad)
    base = kl_type.rstrip("+")
    forward = grpo_loss.kl_penalty_forward(t["log_prob"], t["ref_log_prob"], kl_type)
    torch.testing.assert_close(
        forward, core_algos.kl_penalty_forward(t["log_prob"], t["ref_log_prob"], base)
    )


def test_bad_knobs_name_the_field():
    t = response_tensors()
    with pytest.raises(ValueError, match="loss_agg_mode"):
        grpo_loss.agg_loss(t["entropy"], t["mask"], "token-average")
    with pytest.raises(ValueError, match="batch_num_tokens: required when dp_size > 1"):
        grpo_loss.agg_loss(t["entropy"], t["mask"], "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="kl_penalty"):
        grpo_loss.kl_penalty(t["log_prob"], t["ref_log_prob"], "full")
    with pytest.raises(ValueError, match="meta.actor_config.clip_ratio_c"):
        grpo_loss.verl_grpo_loss(
            {"logprobs": position_indexed(t["log_prob"])},
            wire_batch(t),
            {"actor_config": {"clip_ratio_c": 0.5}},
        )


def test_the_old_import_path_gives_the_same_objects():
    from arctic_platform.engine.losses import get_loss
    from arctic_platform.rl.processors import verl_grpo

    for name in grpo_loss.__all__:
        assert getattr(verl_grpo, name) is getattr(grpo_loss, name), name
    assert get_loss(verl_grpo.LOSS_NAME) is verl_grpo.VerlGrpoLoss
    assert callable(verl_grpo.verl_grpo_loss)
