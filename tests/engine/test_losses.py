"""Each loss against a plainly written per-token implementation (values, gradients, metrics).

The references below loop over rows and tokens with Python floats and hand-written derivatives, so
they share no code with the vectorised losses; the straight-through KL variants are checked through
their defining property (the value of the base estimator, the gradient of k2).
"""

from __future__ import annotations

import math

import pytest
import torch

from arctic_platform.engine.batching import validate_batch
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.losses import LOSSES, get_loss
from arctic_platform.engine.meta import parse_meta
from arctic_platform.engine.metrics import MetricSums, reduce_metrics

AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
]
KL_TYPES = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "abs+", "k3+", "low_var_kl+"]

P, R = 3, 5
S = P + R


def make_batch(seed: int = 0, rows: int = 3):
    """A verl-layout batch: prompt in columns [0, P), responses of varying length after it."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, 90, (rows, S), generator=g)
    attention_mask = torch.zeros(rows, S, dtype=torch.long)
    response_mask = torch.zeros(rows, S)
    for b in range(rows):
        length = R - b % 3  # 5, 4, 3, ...
        attention_mask[b, 1 : P + length] = 1  # one left pad
        response_mask[b, P : P + length] = 1
    logp = -torch.rand(rows, S, generator=g) * 3
    old = logp + (torch.rand(rows, S, generator=g) - 0.5) * 0.8  # ratios on both sides of the clip
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "prompts": input_ids[:, :P],
        "responses": input_ids[:, P:],
        "response_mask": response_mask,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, S) * response_mask,
        "old_log_probs": old * response_mask,
        "ref_log_prob": (logp + torch.randn(rows, S, generator=g) * 0.7) * response_mask,
        "rollout_is_weights": (0.5 + torch.rand(rows, S, generator=g)) * response_mask,
    }
    outputs = {
        "logprobs": (logp * response_mask).requires_grad_(),
        "entropy": (torch.rand(rows, S, generator=g) * 2).requires_grad_(),
    }
    return batch, outputs


def run_loss(name, batch, outputs, meta, config=None):
    parsed = validate_batch(batch)
    loss = get_loss(name)(parsed, parse_meta(meta), config or {})
    rows = {k: v for k, v in loss.tensors.items()}
    result = loss(outputs, rows)
    result.loss.backward()
    return result


# -- plain per-token references ----------------------------------------------------------------


def agg_weights(mode, mask, dp, num_tokens, num_seqs, scale):
    """Weight of each token in the aggregated objective: loss = sum_t w_t * L_t over the mask."""
    weights = [[0.0] * len(row) for row in mask]
    for b, row in enumerate(mask):
        count = sum(row)
        for t, m in enumerate(row):
            if not m:
                continue
            if mode == "token-mean":
                w = dp / num_tokens
            elif mode == "token-sum":
                w = dp
            elif mode == "seq-mean-token-sum":
                w = dp / num_seqs
            elif mode == "seq-mean-token-sum-norm":
                w = dp / num_seqs / scale
            else:
                w = dp / num_seqs / (count + 1e-8)
            weights[b][t] = w
    return weights


def kl_reference(lp, ref, kind):
    """(value, d value / d lp) of one token's KL estimate."""
    base = kind.rstrip("+")
    d = lp - ref
    if base in ("k1", "kl"):
        value, grad = d, 1.0
    elif base == "abs":
        value, grad = abs(d), (1.0 if d > 0 else -1.0)
    elif base in ("k2", "mse"):
        value, grad = 0.5 * d * d, d
    else:
        x = min(max(ref - lp, -20.0), 20.0)
        raw = math.exp(x) - x - 1.0
        value = min(max(raw, -10.0), 10.0)
        grad = -(math.exp(x) - 1.0) if -10.0 < raw < 10.0 and -20 < ref - lp < 20 else 0.0
    if kind.endswith("+"):
        grad = d  # straight-through: the gradient of k2
    return value, grad


def ppo_token_reference(lp, old, adv, eps_low, eps_high, c):
    """(pg, d pg / d lp, clipped?, lower-clipped?, -log_ratio) for one token (verl vanilla)."""
    d = min(max(lp - old, -20.0), 20.0)
    r = math.exp(d)
    dr = r if -20.0 < lp - old < 20.0 else 0.0
    l1, dl1 = -adv * r, -adv * dr
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    rc = min(max(r, lo), hi)
    drc = dr if lo < r < hi else 0.0
    l2, dl2 = -adv * rc, -adv * drc
    lc, dlc = (l1, dl1) if l1 >= l2 else (l2, dl2)
    l3 = -adv * c
    if adv < 0 and l3 < lc:
        pg, dpg = l3, 0.0
    else:
        pg, dpg = lc, dlc
    return pg, dpg, float(l2 > l1), float(lc > l3 and adv < 0), -d


def verl_grpo_reference(batch, outputs, cfg, dp, num_tokens, num_seqs, scale, use_weights):
    mask = batch["response_mask"].tolist()
    lp = outputs["logprobs"].detach().tolist()
    ent = outputs["entropy"].detach().tolist()
    old, adv = batch["old_log_probs"].tolist(), batch["advantages"].tolist()
    ref, isw = batch["ref_log_prob"].tolist(), batch["rollout_is_weights"].tolist()
    weights = agg_weights(cfg["loss_agg_mode"], mask, dp, num_tokens, num_seqs, scale)
    loss = 0.0
    grad_lp = [[0.0] * S for _ in mask]
    grad_ent = [[0.0] * S for _ in mask]
    sums = dict.fromkeys(["pg", "clip", "kl", "lower", "ent", "kll", "loss"], 0.0)
    tokens = 0.0
    for b in range(len(mask)):
        for t in range(S):
            if not mask[b][t]:
                continue
            tokens += 1
            w = weights[b][t]
            pg, dpg, clip, lower, neg_kl = ppo_token_reference(
                lp[b][t],
                old[b][t],
                adv[b][t],
                cfg["clip_ratio_low"],
                cfg["clip_ratio_high"],
                cfg["clip_ratio_c"],
            )
            if use_weights:
                pg, dpg = pg * isw[b][t], dpg * isw[b][t]
            kl, dkl = kl_reference(lp[b][t], ref[b][t], cfg["kl_loss_type"])
            coef_e, coef_k = cfg["entropy_coeff"], cfg["kl_loss_coef"]
            total = pg - coef_e * ent[b][t] + coef_k * kl
            loss += w * total
            grad_lp[b][t] = w * (dpg + coef_k * dkl)
            grad_ent[b][t] = -w * coef_e
            for key, value in zip(
                ["pg", "clip", "kl", "lower", "ent", "kll", "loss"],
                [pg, clip, neg_kl, lower, ent[b][t], kl, total],
                strict=True,
            ):
                sums[key] += value
    metrics = {
        "actor/pg_loss": sums["pg"] / tokens,
        "actor/pg_clipfrac": sums["clip"] / tokens,
        "actor/ppo_kl": sums["kl"] / tokens,
        "actor/pg_clipfrac_lower": sums["lower"] / tokens,
        "actor/entropy_loss": sums["ent"] / tokens,
        "kl_loss": sums["kll"] / tokens,
        "kl_coef": cfg["kl_loss_coef"],
        "loss": sums["loss"] / tokens,
    }
    return loss, torch.tensor(grad_lp), torch.tensor(grad_ent), metrics


# -- verl_grpo ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_verl_grpo_matches_per_token_reference(mode, kl_type):
    batch, outputs = make_batch(seed=AGG_MODES.index(mode) * 100 + KL_TYPES.index(kl_type))
    cfg = {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.1,  # differs from the reference server's hard-coded 0.2
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 2.0,  # differs from the hard-coded 3.0
        "loss_agg_mode": mode,
        "entropy_coeff": 0.01,
        "use_kl_loss": True,
        "kl_loss_coef": 0.05,
        "kl_loss_type": kl_type,
    }
    meta = {"dp_size": 2, "batch_num_tokens": 30, "global_batch_size": 5, "actor_config": cfg}
    result = run_loss("verl_grpo", batch, outputs, meta)
    want_loss, want_glp, want_gent, want_metrics = verl_grpo_reference(
        batch, outputs, cfg, dp=2, num_tokens=30, num_seqs=5, scale=R, use_weights=True
    )
    assert result.loss.item() == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(outputs["logprobs"].grad, want_glp, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(outputs["entropy"].grad, want_gent, rtol=1e-5, atol=1e-7)
    got = MetricSums()
    got.add(result.metrics)
    metrics = got.finalize()
    assert metrics.keys() == want_metrics.keys()
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_verl_grpo_defaults_are_verls():
    """No actor_config: eps 0.2 both sides, c = 3, token-mean over the batch, no KL, no weights."""
    batch, outputs = make_batch(seed=7)
    del batch["rollout_is_weights"]
    outputs = {"logprobs": outputs["logprobs"]}  # no entropy computed
    result = run_loss("verl_grpo", batch, outputs, {})
    tokens = float(batch["response_mask"].sum())
    cfg = {
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean",
        "entropy_coeff": 0.0,
        "kl_loss_coef": 0.0,
        "kl_loss_type": "k1",
    }
    fake = {"logprobs": outputs["logprobs"], "entropy": torch.zeros(3, S)}
    batch["ref_log_prob"] = torch.zeros(3, S)
    batch["rollout_is_weights"] = torch.ones(3, S)
    want_loss, want_glp, _, want_metrics = verl_grpo_reference(
        batch, fake, cfg, dp=1, num_tokens=tokens, num_seqs=3, scale=R, use_weights=False
    )
    assert result.loss.item() == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(outputs["logprobs"].grad, want_glp, rtol=1e-5, atol=1e-7)
    metrics = reduce_metrics([result.metrics])
    assert set(metrics) == {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
        "loss",
    }
    for name, value in metrics.items():
        assert value == pytest.approx(want_metrics[name], rel=1e-5, abs=1e-6), name


def test_straight_through_kl_has_base_value_and_k2_gradient():
    from arctic_platform.engine.losses.kl import kl_penalty

    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.4])
    value = kl_penalty(lp, ref, "k3+")
    torch.testing.assert_close(value, kl_penalty(lp.detach(), ref, "k3"))
    value.sum().backward()
    torch.testing.assert_close(lp.grad, (lp - ref).detach())


def test_nan_outside_the_mask_does_not_poison_gradients():
    batch, outputs = make_batch(seed=3)
    batch["old_log_probs"] = batch["old_log_probs"].masked_fill(
        batch["response_mask"] == 0, math.nan
    )
    batch["advantages"] = batch["advantages"].masked_fill(batch["response_mask"] == 0, math.inf)
    cfg = {"use_kl_loss": False}
    result = run_loss("verl_grpo", batch, outputs, {"actor_config": cfg})
    assert torch.isfinite(result.loss)
    assert torch.isfinite(outputs["logprobs"].grad).all()


@pytest.mark.parametrize(
    ("meta", "field"),
    [
        ({"actor_config": {"loss_agg_mode": "mean"}}, "meta.actor_config.loss_agg_mode"),
        ({"actor_config": {"kl_loss_type": "full"}}, "meta.actor_config.kl_loss_type"),
        ({"actor_config": {"clip_ratio_c": 1.0}}, "meta.actor_config.clip_ratio_c"),
        ({"actor_config": {"clip_ratio": "0.2"}}, "meta.actor_config.clip_ratio"),
        ({"actor_config": {"use_kl_loss": 1}}, "meta.actor_config.use_kl_loss"),
        ({"policy_loss_config": {"loss_mode": "gspo"}}, "meta.policy_loss_config.loss_mode"),
        ({"dp_size": 2}, "meta.batch_num_tokens"),
        ({"dp_size": 0}, "meta.dp_size"),
        ({"rollout_is_weights": torch.ones(3, R)}, "meta.rollout_is_weights"),
    ],
)
def test_verl_grpo_rejects_bad_knobs(meta, field):
    batch, _ = make_batch()
    with pytest.raises(EngineInputError) as info:
        get_loss("verl_grpo")(validate_batch(batch), parse_meta(meta), {})
    assert info.value.field == field


def test_verl_grpo_needs_ref_log_prob_only_with_kl():
    batch, _ = make_batch()
    del batch["ref_log_prob"]
    get_loss("verl_grpo")(validate_batch(batch), parse_meta({}), {})
    with pytest.raises(EngineInputError) as info:
        meta = parse_meta({"actor_config": {"use_kl_loss": True}})
        get_loss("verl_grpo")(validate_batch(batch), meta, {})
    assert info.value.field == "batch.ref_log_prob"


def test_nan_on_a_used_token_is_rejected():
    batch, _ = make_batch()
    batch["advantages"] = batch["advantages"].clone()
    batch["advantages"][1, P] = math.nan
    with pytest.raises(EngineInputError) as info:
        get_loss("verl_grpo")(validate_batch(batch), parse_meta({}), {})
    assert info.value.field == "batch.advantages"


# -- Tinker losses --------------------------------------------------------------------------


def test_every_tinker_loss_is_the_registered_engine_loss_of_its_name():
    """The Tinker API implements no loss of its own: it asks the registry for the same name."""
    from arctic_platform.server.tinker import losses as tinker_losses

    assert set(tinker_losses.LOSSES) <= set(LOSSES)
    for name in tinker_losses.LOSSES:
        assert tinker_losses.processing_for(name, {})["loss_fn"] == name


def tinker_reference(kind, batch, outputs, low, high, mode, dp=1):
    mask = batch["response_mask"].tolist()
    lp = outputs["logprobs"].detach().tolist()
    old, adv = batch["old_log_probs"].tolist(), batch["advantages"].tolist()
    tokens = sum(map(sum, mask))
    weights = agg_weights(mode, mask, dp, tokens, len(mask), R)
    loss, grad = 0.0, [[0.0] * S for _ in mask]
    for b in range(len(mask)):
        for t in range(S):
            if not mask[b][t]:
                continue
            r = math.exp(lp[b][t] - old[b][t])
            a = adv[b][t]
            if kind == "importance_sampling":
                value, dvalue = -r * a, -r * a
            elif kind == "ppo":
                rc = min(max(r, low), high)
                if r * a <= rc * a:
                    value, dvalue = -r * a, -r * a
                else:
                    value, dvalue = -rc * a, (-r * a if low < r < high else 0.0)
            else:
                rc = min(max(r, low), high)
                value, dvalue = -rc * lp[b][t] * a, -rc * a
            loss += weights[b][t] * value
            grad[b][t] = weights[b][t] * dvalue
    return loss, torch.tensor(grad)


@pytest.mark.parametrize("kind", ["importance_sampling", "ppo", "cispo"])
@pytest.mark.parametrize("mode", [None, *AGG_MODES])
def test_tinker_losses_match_reference(kind, mode):
    batch, outputs = make_batch(seed=11)
    low, high = {"ppo": (0.85, 1.1), "cispo": (0.9, 1.05)}.get(kind, (0.0, 0.0))
    config = (
        {"clip_low_threshold": low, "clip_high_threshold": high}
        if kind != "importance_sampling"
        else {}
    )
    if mode is not None:
        config["loss_agg_mode"] = mode
    result = run_loss(kind, batch, {"logprobs": outputs["logprobs"]}, {}, config)
    want_loss, want_grad = tinker_reference(kind, batch, outputs, low, high, mode or "token-sum")
    assert result.loss.item() == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(outputs["logprobs"].grad, want_grad, rtol=1e-5, atol=1e-7)


def test_tinker_default_thresholds():
    batch, outputs = make_batch(seed=5)
    for kind, (low, high) in {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}.items():
        lp = outputs["logprobs"].detach().clone().requires_grad_()
        result = run_loss(kind, batch, {"logprobs": lp}, {})
        want, _ = tinker_reference(kind, batch, {"logprobs": lp}, low, high, "token-sum")
        assert result.loss.item() == pytest.approx(want, rel=1e-5)


def test_dro_matches_its_formula_and_needs_beta():
    batch, outputs = make_batch(seed=9)
    beta = 0.3
    result = run_loss("dro", batch, {"logprobs": outputs["logprobs"]}, {}, {"beta": beta})
    mask = batch["response_mask"].tolist()
    lp = outputs["logprobs"].detach().tolist()
    old, adv = batch["old_log_probs"].tolist(), batch["advantages"].tolist()
    want, grad = 0.0, torch.zeros(3, S)
    for b in range(3):
        for t in range(S):
            if mask[b][t]:
                # loss = -(logp A - beta/2 (logp - q)^2); d/dlogp = -(A - beta (logp - q))
                want += -(lp[b][t] * adv[b][t] - 0.5 * beta * (lp[b][t] - old[b][t]) ** 2)
                grad[b, t] = -(adv[b][t] - beta * (lp[b][t] - old[b][t]))
    assert result.loss.item() == pytest.approx(want, rel=1e-5)
    torch.testing.assert_close(outputs["logprobs"].grad, grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(EngineInputError) as info:
        run_loss("dro", batch, {"logprobs": outputs["logprobs"]}, {}, {})
    assert info.value.field == "processing.config.beta"


def test_policy_losses_score_the_labels_when_given():
    batch, _ = make_batch(seed=4)
    labels = torch.full_like(batch["input_ids"], -100)
    labels[batch["response_mask"] > 0] = 7
    parsed = validate_batch({**batch, "labels": labels})
    loss = get_loss("importance_sampling")(parsed, parse_meta({}), {})
    want = torch.where(labels != -100, labels, batch["input_ids"])
    assert torch.equal(loss.targets, want)


# -- cross entropy --------------------------------------------------------------------------


def test_cross_entropy_with_labels_ignores_minus_100_and_first_tokens():
    batch, outputs = make_batch(seed=2)
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    labels[0, 5] = -100
    data = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": labels,
    }
    lp = outputs["logprobs"]
    result = run_loss("cross_entropy", data, {"logprobs": lp}, {})
    used = []
    for b in range(3):
        first = int(batch["attention_mask"][b].nonzero()[0])
        used += [(b, t) for t in range(first + 1, S) if labels[b, t] != -100]
    want = sum(-lp[b, t].item() for b, t in used) / len(used)
    assert result.loss.item() == pytest.approx(want, rel=1e-6)
    grad = torch.zeros(3, S)
    for b, t in used:
        grad[b, t] = -1.0 / len(used)
    torch.testing.assert_close(lp.grad, grad)
    assert reduce_metrics([result.metrics])["loss"] == pytest.approx(want, rel=1e-6)


def test_cross_entropy_targets_are_the_labels():
    """Labels that differ from input_ids are what gets scored (the engine scores ``targets``)."""
    batch, _ = make_batch()
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, P] = 42
    data = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": labels,
    }
    loss = get_loss("cross_entropy")(validate_batch(data), parse_meta({}), {})
    assert (loss.targets[:, P] == 42).all()
    assert (loss.targets[:, P + 1] == batch["input_ids"][:, P + 1]).all()


def test_cross_entropy_without_labels_uses_the_loss_mask():
    batch, outputs = make_batch(seed=4)
    data = {k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")}
    lp = outputs["logprobs"]
    result = run_loss("cross_entropy", data, {"logprobs": lp}, {"batch_num_tokens": 20})
    mask = batch["response_mask"].bool()
    assert result.loss.item() == pytest.approx(float(-lp.detach()[mask].sum() / 20), rel=1e-6)
    with pytest.raises(EngineInputError) as info:
        get_loss("cross_entropy")(
            validate_batch({k: batch[k] for k in ("input_ids", "attention_mask")}),
            parse_meta({}),
            {},
        )
    assert info.value.field == "batch.labels"


# -- registry and metrics ---------------------------------------------------------------------


def test_cross_entropy_loss_weights_scale_each_target():
    batch, outputs = make_batch(seed=3)
    labels = batch["input_ids"].clone()
    labels[batch["response_mask"] == 0] = -100
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(3, S, generator=g) * batch["response_mask"]
    data = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": labels,
        "loss_weights": weights,
    }
    lp = outputs["logprobs"]
    result = run_loss("cross_entropy", data, {"logprobs": lp}, {}, {"loss_agg_mode": "token-sum"})
    used = labels != -100
    want = -(lp.detach() * weights)[used].sum().item()  # Tinker: sum(-logp * weights)
    assert result.loss.item() == pytest.approx(want, rel=1e-6)
    assert result.metrics["loss.sum"].item() == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(lp.grad, torch.where(used, -weights, torch.zeros(())))


def test_registry_knows_every_builtin_and_names_unknown_ones():
    assert {"verl_grpo", "ppo", "importance_sampling", "cispo", "dro", "cross_entropy"} <= set(
        LOSSES
    )
    with pytest.raises(EngineInputError) as info:
        get_loss("grpo_typo")
    assert info.value.field == "processing.loss_fn"
    assert "grpo_typo" in str(info.value)


def test_reduce_metrics_is_a_global_token_mean():
    # The reference server's pinned examples.
    assert reduce_metrics([{"x.sum": 10, "x.tokens": 2}, {"x.sum": 30, "x.tokens": 6}]) == {
        "x": 5.0
    }
    assert reduce_metrics([{"x.sum": 4, "x.tokens": 2}, {"x.sum": 8, "x.tokens": 1}]) == {"x": 4.0}
    assert reduce_metrics([{"c": 1.5}, {"c": 2.5}]) == {"c": 2.0}
    assert reduce_metrics([{"x.sum": 0.0, "x.tokens": 0.0}]) == {"x": 0.0}
