"""The reference's Cortex GRPO contract over the Cortex routes of the real server.

The request is shaped the way the reference's Cortex dispatch shapes it: ``{args: [], kwargs:
{input_ids, attention_mask}, context: {input_ids, advantages, loss_mask, old_log_probs_shifted,
...}, processing: {post: ["compute_logprobs"], loss_fn: "grpo", config}}``, with rows left-aligned
and context tensors in the shifted layout (column ``i`` scores ``input_ids[:, i + 1]``). The loss
and the gradients the server accumulates are checked against a plain per-token computation: each
row through the HF model on its own, one Python-level term per token, autograd for the gradient.
"""

from __future__ import annotations

import pytest
import torch

from arctic_platform.engine.config import ModelConfig
from arctic_platform.engine.models import load_causal_lm
from tests.server.conftest import CORTEX, OCTET, TINY, job_request
from tests.server.test_cortex import create, submit_frame, wire
from tests.waiting import wait_until

LENGTHS = [(3, 5), (5, 2), (2, 6), (4, 4)]  # (prompt, response) per row
WIDTH = 10


def contract_request(seed: int = 0) -> tuple[dict, dict]:
    """``(kwargs, context)`` of four left-aligned rows with shifted per-token context."""
    g = torch.Generator().manual_seed(seed)
    rows = len(LENGTHS)
    input_ids = torch.zeros(rows, WIDTH, dtype=torch.long)
    attention_mask = torch.zeros(rows, WIDTH, dtype=torch.long)
    loss_mask = torch.zeros(rows, WIDTH, dtype=torch.bool)
    for b, (p, r) in enumerate(LENGTHS):
        input_ids[b, : p + r] = torch.randint(5, 90, (p + r,), generator=g)
        attention_mask[b, : p + r] = 1
        loss_mask[b, p - 1 : p + r - 1] = True  # shifted: column i scores token i + 1
    advantages = torch.randn(rows, 1, generator=g).expand(rows, WIDTH) * loss_mask
    return {"input_ids": input_ids, "attention_mask": attention_mask}, {
        "input_ids": input_ids,
        "advantages": advantages.contiguous(),
        "loss_mask": loss_mask,
    }


def shifted_logprobs(model, kwargs) -> list[list[torch.Tensor]]:
    """Per row, ``log p(input_ids[i + 1] | input_ids[: i + 1])`` for each real column ``i``."""
    out = []
    for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"], strict=True):
        length = int(mask.sum())
        logits = model(input_ids=ids[None, :length]).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        out.append([logp[i, ids[i + 1]] for i in range(length - 1)])
    return out


def reference_loss(logps, context, config, *, num_tokens, num_seqs):
    """The contract's objective written token by token (module doc of cortex_grpo)."""
    eps, eps_high = config["eps_clip"], config["eps_clip_higher"]
    total, per_token, clipped, count = 0.0, 0.0, 0, 0
    for b, row in enumerate(logps):
        seq_terms = []
        for i, lp in enumerate(row):
            if not context["loss_mask"][b, i]:
                continue
            adv = float(context["advantages"][b, i])
            old = float(context["old_log_probs_shifted"][b, i])
            ratio = torch.exp(lp - old)
            loss1, loss2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - eps, 1 + eps_high)
            pg = torch.maximum(loss1, loss2)
            pg = torch.minimum(pg, torch.tensor(config["c_clip"] * abs(adv)))
            ref = float(context["ref_log_probs_shifted"][b, i])
            kl = torch.clamp(torch.exp(ref - lp) - (ref - lp) - 1, -10, 10)  # low_var_kl
            term = pg + config["kl_loss_coef"] * kl
            seq_terms.append(term)
            per_token += term.item()
            clipped += int(loss1.item() < loss2.item())
            count += 1
        if config["loss_agg_mode"] == "token-mean":
            total = total + sum(seq_terms) / num_tokens
        else:  # seq-mean-token-mean
            total = total + sum(seq_terms) / len(seq_terms) / num_seqs
    return total, per_token / count, clipped / count


def failure_of(http, job_id: str, response) -> str:
    """The error of a submitted request that fails when it runs (polled with a deadline)."""
    assert response.status_code == 200, response.text
    url = f"{CORTEX}/{job_id}/requests/{response.json()['request_id']}"

    def ended() -> dict | None:
        status = http.get(url).json()
        return None if status["status"] in ("pending", "running") else status

    status = wait_until(ended, what=f"{url} ended")
    assert status["status"] == "failed", status
    return status["error"]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_grpo_contract_loss_and_gradients_match_a_per_token_computation(http, service, mode):
    job_id = create(http, job_request("training"))
    trainer = service.resolve(job_id, owner=None, kind="training").engine
    model = load_causal_lm(ModelConfig(name=TINY, device="cpu"))
    model.load_state_dict(trainer.model.state_dict())
    kwargs, context = contract_request()
    with torch.no_grad():
        now = shifted_logprobs(model, kwargs)
    old = torch.zeros(len(LENGTHS), WIDTH)
    ref = torch.zeros(len(LENGTHS), WIDTH)
    g = torch.Generator().manual_seed(1)
    for b, row in enumerate(now):
        for i, lp in enumerate(row):
            old[b, i] = lp + (torch.rand((), generator=g) - 0.5) * 0.8  # both sides of the clip
            ref[b, i] = lp + torch.randn((), generator=g) * 0.5
    context.update(
        old_log_probs_shifted=old * context["loss_mask"],
        ref_log_probs_shifted=ref * context["loss_mask"],
    )
    tokens = int(context["loss_mask"].sum())
    config = {
        "eps_clip": 0.2,
        "eps_clip_higher": 0.28,
        "c_clip": 3.0,
        "loss_agg_mode": mode,
        "entropy_coeff": 0.0,
        "use_kl_loss": True,
        "kl_loss_coef": 0.1,
        "kl_loss_type": "low_var_kl",
        "batch_num_tokens": tokens,
        "global_batch_size": len(LENGTHS),
    }
    body = {
        "args": [],
        "kwargs": kwargs,
        "context": context,
        "processing": {"post": ["compute_logprobs"], "loss_fn": "grpo", "config": config},
    }
    result = submit_frame(http, job_id, "forward-backward", body)

    objective, token_mean, clip_fraction = reference_loss(
        shifted_logprobs(model, kwargs), context, config, num_tokens=tokens, num_seqs=len(LENGTHS)
    )
    objective.backward()
    assert result["avg_loss"] == pytest.approx(token_mean, abs=1e-5)
    assert result["metrics"]["clip_ratio"] == pytest.approx(clip_fraction, abs=1e-6)
    assert 0 < clip_fraction < 1
    served = dict(trainer.model.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(served[name].grad, param.grad, atol=2e-5, rtol=1e-3)


def test_context_wins_and_a_conflict_is_refused(http, service):
    job_id = create(http, job_request("training"))
    kwargs, context = contract_request()
    processing = {"post": ["compute_logprobs"], "loss_fn": "grpo"}
    tokens = int(context["loss_mask"].sum())
    agreeing = {
        "args": [],
        "kwargs": kwargs,
        "context": {**context, "batch_num_tokens": tokens},
        "processing": {**processing, "config": {"batch_num_tokens": tokens}},
    }
    assert "avg_loss" in submit_frame(http, job_id, "forward-backward", agreeing)
    conflicting = {
        **agreeing,
        "processing": {**processing, "config": {"batch_num_tokens": tokens + 1}},
    }
    frame = wire.dumps(conflicting)
    response = http.post(f"{CORTEX}/{job_id}/forward-backward", content=frame, headers=OCTET)
    error = failure_of(http, job_id, response)
    assert "processing.config.batch_num_tokens" in error
    assert "conflicting batch_num_tokens" in error


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"processing": {"loss_fn": "grpo_typo"}}, "unknown loss 'grpo_typo'"),
        ({"processing": {"post": ["compute_logprob"], "loss_fn": "grpo"}}, "compute_logprob"),
        ({"context_extra": {"versions": torch.zeros(4, WIDTH)}}, "context.versions"),
        (
            {"processing": {"loss_fn": "grpo", "config": {"aux_ce_weight": 0.1}}},
            "processing.config.aux_ce_weight",
        ),
        ({"context_extra": {"input_ids": torch.ones(4, WIDTH, dtype=torch.long)}}, "differs"),
        (
            {"context_extra": {"loss_mask": torch.full((4, WIDTH), 0.5).tril(diagonal=WIDTH - 2)}},
            "context.loss_mask: must be binary",
        ),
        ({"context_extra": {"loss_mask": torch.ones(4, WIDTH - 1)}}, "context.loss_mask"),
    ],
)
def test_bad_contract_requests_are_refused_at_submit(http, service, change, message):
    job_id = create(http, job_request("training"))
    kwargs, context = contract_request()
    body = {
        "args": [],
        "kwargs": kwargs,
        "context": {**context, **change.get("context_extra", {})},
        "processing": change.get("processing", {"loss_fn": "grpo"}),
    }
    response = http.post(
        f"{CORTEX}/{job_id}/forward-backward", content=wire.dumps(body), headers=OCTET
    )
    if response.status_code == 200:  # refused by the loss, when the request ran
        assert message in failure_of(http, job_id, response)
        assert "aux_ce_weight" in message  # only config knobs are checked when the loss runs
    else:
        assert response.status_code == 400 and message in response.text, response.text


def test_a_token_aligned_loss_mask_is_read_as_the_reference_reads_it(http, service):
    """A SkyRL shim's response mask (token-aligned, one row filling the width) is taken as shifted,
    as the reference takes it: column i scores ``roll(input_ids, -1)[:, i]``, so a row's last
    response token scores the padding after it, or, on the full row, ``input_ids[:, 0]``."""
    job_id = create(http, job_request("training"))
    trainer = service.resolve(job_id, owner=None, kind="training").engine
    model = load_causal_lm(ModelConfig(name=TINY, device="cpu"))
    model.load_state_dict(trainer.model.state_dict())
    lengths = [(3, 4), (4, WIDTH - 4)]  # the second row fills the width
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(len(lengths), WIDTH, dtype=torch.long)
    attention = torch.zeros_like(ids)
    response = torch.zeros_like(ids)
    for b, (p, r) in enumerate(lengths):
        ids[b, : p + r] = torch.randint(5, 90, (p + r,), generator=g)
        attention[b, : p + r] = 1
        response[b, p : p + r] = 1  # token-aligned
    advantages = torch.tensor([[0.7], [-1.3]]) * response
    tokens = int(response.sum())
    body = {
        "args": [],
        "kwargs": {"input_ids": ids, "attention_mask": attention},
        "context": {"input_ids": ids, "advantages": advantages, "loss_mask": response.bool()},
        "processing": {
            "post": ["compute_logprobs"],
            "loss_fn": "grpo",
            "config": {"batch_num_tokens": tokens},
        },
    }
    result = submit_frame(http, job_id, "forward-backward", body)

    target = torch.roll(ids, -1, dims=1)
    objective = 0.0
    for b, (p, r) in enumerate(lengths):
        logp = torch.log_softmax(model(input_ids=ids[b : b + 1, : p + r]).logits[0].float(), -1)
        for i in range(p, p + r):  # old log-probs omitted: ratio 1, the term is -A * logp / N
            lp = logp[i, target[b, i]]
            objective = objective - advantages[b, i] * torch.exp(lp - lp.detach()) / tokens
    objective.backward()
    assert result["avg_loss"] == pytest.approx(-float(advantages.sum()) / tokens, abs=1e-6)
    served = dict(trainer.model.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(served[name].grad, param.grad, atol=2e-5, rtol=1e-3)


def test_grpo_echo_v1_adds_the_environment_prediction_term_and_keeps_its_schema(http, service):
    """ECHO's term against a per-token computation: per row, the NLL of the target tokens O'
    over the observation span's length |O|, summed and divided by the client's sequence count;
    then the contract's refusals, each naming its field."""
    job_id = create(http, job_request("training"))
    trainer = service.resolve(job_id, owner=None, kind="training").engine
    model = load_causal_lm(ModelConfig(name=TINY, device="cpu"))
    model.load_state_dict(trainer.model.state_dict())
    width, lengths = 12, [12, 10, 11]
    g = torch.Generator().manual_seed(5)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    policy, observation, target = (
        torch.zeros(len(lengths), width, dtype=torch.bool) for _ in "pot"
    )
    for b, length in enumerate(lengths):  # prompt 0-2, policy 3-5, observation 6-8, policy 9-
        ids[b, :length] = torch.randint(5, 90, (length,), generator=g)
        attention[b, :length] = 1
        policy[b, 3:6] = policy[b, 9:length] = True
        observation[b, 6:9] = True
        target[b, 7 + b % 2 : 9] = True  # O' inside O
    advantages = torch.tensor([[0.9], [-0.4], [1.5]]) * policy

    def shifted(t):  # position-indexed -> the context layout (column i scores token i + 1)
        return torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)

    tokens, sequences, weight = int(policy.sum()), 4, 0.5
    config = {"batch_num_tokens": tokens, "aux_ce_weight": weight}
    config["echo_global_num_sequences"] = sequences
    context = {
        "input_ids": ids,
        "advantages": shifted(advantages),
        "loss_mask": shifted(policy),
        "sft_mask": shifted(target),
        "echo_observation_mask": shifted(observation),
    }

    def body(config, context=context):
        processing = {"post": ["compute_logprobs"], "loss_fn": "grpo_echo_v1", "config": config}
        kwargs = {"input_ids": ids, "attention_mask": attention}
        return {"args": [], "kwargs": kwargs, "context": context, "processing": processing}

    result = submit_frame(http, job_id, "forward-backward", body(config))

    objective, nll, count = 0.0, 0.0, 0
    for b, length in enumerate(lengths):
        logits = model(input_ids=ids[b : b + 1, :length]).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        env = 0.0
        for t in range(1, length):
            lp = logp[t - 1, ids[b, t]]
            if policy[b, t]:  # no old log-probs: ratio 1
                objective = objective - advantages[b, t] * torch.exp(lp - lp.detach()) / tokens
            if target[b, t]:
                env = env - lp
                nll, count = nll - lp.item(), count + 1
        objective = objective + weight * env / int(observation[b].sum()) / sequences
    objective.backward()
    served = dict(trainer.model.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(served[name].grad, param.grad, atol=2e-5, rtol=1e-3)
    metrics = result["metrics"]
    assert metrics["echo_contract_version"] == 1.0 and metrics["echo_aux_ce_weight"] == weight
    assert metrics["echo_environment_prediction_nll"] == pytest.approx(nll / count, rel=1e-5)

    for bad, field in [
        ({**config, "aux_ce_weigth": 0.1}, "processing.config.aux_ce_weigth"),
        ({**config, "echo_global_num_sequences": None}, "echo_global_num_sequences"),
        ({**config, "echo_global_num_sequences": 2}, "echo_global_num_sequences"),
        ({**config, "echo_batch_denominator": "rows"}, "echo_batch_denominator"),
    ]:
        frame = wire.dumps(body(bad))
        response = http.post(f"{CORTEX}/{job_id}/forward-backward", content=frame, headers=OCTET)
        assert field in failure_of(http, job_id, response)
    overlapping = {**context, "sft_mask": context["sft_mask"] | context["loss_mask"]}
    frame = wire.dumps(body(config, overlapping))
    response = http.post(f"{CORTEX}/{job_id}/forward-backward", content=frame, headers=OCTET)
    assert "batch.sft_mask" in failure_of(http, job_id, response)
    for bad in (body(config), body({"batch_num_tokens": tokens})):  # ECHO keys or masks on grpo
        bad["processing"]["loss_fn"] = "grpo"
        frame = wire.dumps(bad)
        response = http.post(f"{CORTEX}/{job_id}/forward-backward", content=frame, headers=OCTET)
        assert "grpo_echo_v1" in failure_of(http, job_id, response)
