"""Four GRPO steps the way verl's trainer runs them, on the built-in tiny model, in this process.

verl's own driver code does the work: ``RayPPOTrainer._compute_old_log_prob``,
``_compute_ref_log_prob`` and ``_update_actor`` (bound to a stand-in trainer object that holds our
forwarder as its worker group), ``DataProto`` batches, ``compute_response_mask``, GRPO advantages
from ``core_algos.compute_grpo_outcome_advantage`` and ``reduce_metrics``. Our parts: the adapter
(driver, owning the jobs on the ``inprocess`` backend), the forwarder worker and the rollout
replica's token server, each attached through the reconnect handle as in separate verl processes.

Checked against independent computations: the log-probs and entropies verl receives equal a
direct transformers forward pass (predict-next order, temperature applied), before training
(policy and reference) and after it (from the saved checkpoint); the sampler serves the trained
weights after ``update_weights`` (greedy continuations equal transformers' ``generate`` on the
checkpoint); at every step the PPO objective of the step's batch, evaluated with verl's own policy
loss on the log-probs verl reads back, is lower after the update than before; every metric key
verl logs is there.
"""

from __future__ import annotations

import asyncio
import math
import types

import numpy as np
import pytest
import torch

from tests.integrations.verl.conftest import TINY, inprocess_overrides

PROMPTS = ([40, 41, 42, 43], [50, 51, 52])
N, STEPS, P, R = 4, 4, 8, 6
TEMPERATURE = 0.8
LOOP_OVERRIDES = (
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.entropy_coeff=0.001",
)
# What verl's trainer logs from update_actor (after prefixing "actor/" and moving mfu).
ACTOR_KEYS = {
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
    "actor/entropy_loss",
    "actor/kl_loss",
    "actor/kl_coef",
    "actor/loss",
    "actor/grad_norm",
    "actor/lr",
    "perf/mfu/actor",
}


def reward(tokens: list[int]) -> float:
    """A reward the policy can learn token by token: the share of even token ids."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


@pytest.fixture(scope="module")
def run(compose_verl, tmp_path_factory, worker_env):
    """The three verl-side parts, attached to one set of jobs, and verl's trainer methods."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper
    from arctic_platform.integrations.verl.register import load_replica, load_worker
    from arctic_platform.integrations.verl.rollout import ArcticTokenServer

    data_dir = tmp_path_factory.mktemp("loop")
    config = compose_verl(*inprocess_overrides(data_dir), *LOOP_OVERRIDES)
    driver = ArcticRLClientWrapper.from_config(config)
    handle = driver.reconnect_handle()
    worker = load_worker()(
        config.actor_rollout_ref, "actor_rollout_ref", main_config=config, backend_handle=handle
    )
    worker.init_model()
    replica = load_replica()(
        0,
        config.actor_rollout_ref.rollout,
        config.actor_rollout_ref.model,
        1,
        main_config=config,
        backend_handle=handle,
    )
    server = ArcticTokenServer(**replica.server_kwargs())
    trainer = types.SimpleNamespace(
        config=config,
        actor_rollout_wg=worker,
        ref_policy_wg=worker,
        ref_in_actor=False,
        distillation_config=None,
    )
    yield types.SimpleNamespace(
        config=config,
        driver=driver,
        worker=worker,
        replica=replica,
        server=server,
        trainer=trainer,
        verl=RayPPOTrainer,
        checkpoints=data_dir / "checkpoints",
    )
    driver.destroy()


def rollout(server, config) -> list[tuple[list[int], list[int]]]:
    """verl's agent loop: one concurrent token-in/token-out request per sample."""
    rollout_config = config.actor_rollout_ref.rollout
    params = {
        "temperature": rollout_config.temperature,
        "top_p": rollout_config.top_p,
        "top_k": rollout_config.top_k,
        "repetition_penalty": 1.0,
        "logprobs": rollout_config.calculate_log_probs,
    }

    async def all_samples():
        prompts = [p for p in PROMPTS for _ in range(N)]
        calls = [server.generate(p, dict(params), f"req-{i}") for i, p in enumerate(prompts)]
        return prompts, await asyncio.gather(*calls)

    prompts, outputs = asyncio.run(all_samples())
    for out in outputs:
        assert out.stop_reason == "completed" and len(out.log_probs) == len(out.token_ids)
    return [(p, list(o.token_ids)) for p, o in zip(prompts, outputs, strict=True)]


def data_proto(samples):
    """The DataProto verl's agent loop returns: prompts left-, responses right-padded."""
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_response_mask

    rows = len(samples)
    prompts = torch.zeros(rows, P, dtype=torch.long)
    responses = torch.zeros(rows, R, dtype=torch.long)
    attention_mask = torch.zeros(rows, P + R, dtype=torch.long)
    for b, (prompt, response) in enumerate(samples):
        prompts[b, P - len(prompt) :] = torch.tensor(prompt)
        responses[b, : len(response)] = torch.tensor(response)
        attention_mask[b, P - len(prompt) : P + len(response)] = 1
    uid = np.array([str(b // N) for b in range(rows)], dtype=object)
    batch = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        },
        non_tensors={"uid": uid},
        meta_info={"temperature": TEMPERATURE},
    )
    batch.batch["response_mask"] = compute_response_mask(batch)
    return batch


def direct_scores(model, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """Response log-probs and entropies ``[B, R]`` by a plain transformers forward pass, one
    unpadded sequence at a time, with the rollout temperature (verl's convention)."""
    logps = torch.zeros(len(samples), R)
    entropies = torch.zeros(len(samples), R)
    with torch.no_grad():
        for b, (prompt, response) in enumerate(samples):
            ids = torch.tensor([prompt + response])
            logits = model(ids).logits[0].float() / TEMPERATURE
            logp = torch.log_softmax(logits, dim=-1)
            for k, token in enumerate(response):
                position = len(prompt) - 1 + k  # the output that predicts response token k
                logps[b, k] = logp[position, token]
                entropies[b, k] = -(logp[position].exp() * logp[position]).sum()
    return logps, entropies


def policy_objective(batch, current_log_probs) -> float:
    """verl's vanilla PPO objective of ``batch`` under the current policy."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo import core_algos

    config = OmegaConf.create(
        {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "global_batch_info": {}}
    )
    loss, _ = core_algos.compute_policy_loss_vanilla(
        old_log_prob=batch.batch["old_log_probs"],
        log_prob=current_log_probs,
        advantages=batch.batch["advantages"],
        response_mask=batch.batch["response_mask"].bool(),
        config=config,
    )
    return float(loss)


def hf_model(path=None):
    from transformers import AutoModelForCausalLM

    from arctic_platform.engine.builtin import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(path or resolve_model_path(TINY))
    return model.float().eval()


def test_four_grpo_steps_through_verls_trainer_code(run):
    from verl.trainer.ppo import core_algos
    from verl.utils.metric import reduce_metrics

    initial = hf_model()
    objectives = []
    for step in range(1, STEPS + 1):
        samples = rollout(run.server, run.config)
        batch = data_proto(samples)
        old, mfu = run.verl._compute_old_log_prob(run.trainer, batch)
        assert math.isfinite(mfu) and mfu > 0
        batch = batch.union(old)
        ref = run.verl._compute_ref_log_prob(run.trainer, batch)
        batch = batch.union(ref)

        # The reference policy is frozen: always the initial weights.
        want_ref, want_entropy = direct_scores(initial, samples)
        mask = batch.batch["response_mask"].bool()
        torch.testing.assert_close(
            batch.batch["ref_log_prob"][mask], want_ref[mask], rtol=1e-4, atol=1e-5
        )
        if step == 1:  # before any update the policy is the initial model too
            torch.testing.assert_close(
                batch.batch["old_log_probs"][mask], want_ref[mask], rtol=1e-4, atol=1e-5
            )
            torch.testing.assert_close(
                batch.batch["entropys"][mask], want_entropy[mask], rtol=1e-4, atol=1e-5
            )
        batch.pop(batch_keys=["entropys"])

        scores = torch.zeros(len(samples), R)
        for b, (_, response) in enumerate(samples):
            scores[b, len(response) - 1] = reward(response)
        advantages, returns = core_algos.compute_grpo_outcome_advantage(
            scores, batch.batch["response_mask"], batch.non_tensor_batch["uid"]
        )
        batch.batch["advantages"], batch.batch["returns"] = advantages, returns
        before = policy_objective(batch, batch.batch["old_log_probs"])

        output = run.verl._update_actor(run.trainer, batch)
        per_update = output.meta_info["metrics"]
        assert len(per_update["actor/lr"]) == 2  # 8 rows in mini-batches of 1 prompt x 4 samples
        metrics = reduce_metrics(per_update)
        assert set(metrics) >= ACTOR_KEYS, ACTOR_KEYS - set(metrics)
        assert all(math.isfinite(float(v)) for v in metrics.values())
        assert metrics["actor/lr"] == pytest.approx(0.003)
        assert metrics["actor/kl_coef"] == pytest.approx(0.01)
        assert metrics["actor/grad_norm"] > 0

        after = policy_objective(batch, current_log_probs(run, batch))
        objectives.append((before, after))

        assert run.worker.update_weights(global_steps=step, mode="naive")
        asyncio.run(run.server.set_global_steps(step))

    # The update lowers the objective of the batch it trained on, at every step.
    assert all(after < before - 1e-3 for before, after in objectives), objectives

    # After training: verl's log-probs are the trained weights' (read back from the checkpoint),
    # and the sampler generates with them.
    saved = run.worker.save_checkpoint(str(run.checkpoints / "global_step_4" / "actor"))
    assert saved["global_step"] == STEPS * 2  # one optimizer update per mini-batch
    trained = hf_model(saved["path"])
    want, _ = direct_scores(trained, samples)
    got = current_log_probs(run, batch)
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-4, atol=1e-5)
    greedy = {"temperature": 0.0, "max_tokens": R, "logprobs": False}
    for prompt in PROMPTS:
        served = asyncio.run(run.server.generate(prompt, dict(greedy), "greedy"))
        direct = trained.generate(
            torch.tensor([prompt]), max_new_tokens=R, do_sample=False, eos_token_id=[3, 1]
        )[0, len(prompt) :].tolist()
        assert served.token_ids == direct[: len(served.token_ids)]
        assert served.extra_fields["global_steps"] == STEPS


def current_log_probs(run, batch) -> torch.Tensor:
    """The policy's log-probs of ``batch`` as verl's trainer reads them from the forwarder."""
    fresh = batch.select(
        batch_keys=[
            "prompts",
            "responses",
            "input_ids",
            "attention_mask",
            "position_ids",
            "response_mask",
        ]
    )
    fresh.meta_info = {"temperature": TEMPERATURE}
    old, _ = run.verl._compute_old_log_prob(run.trainer, fresh)
    return old.batch["old_log_probs"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("no_ref_log_prob", "batch.ref_log_prob: missing"),
        ("nan_in_last_mini_batch", r"batch.advantages: NaN or infinity .*row 7"),
    ],
)
def test_a_bad_batch_is_refused_before_any_update(run, damage, message):
    batch = data_proto(rollout(run.server, run.config))
    old, _ = run.verl._compute_old_log_prob(run.trainer, batch)
    batch = batch.union(old)
    batch.pop(batch_keys=["entropys"])
    if damage != "no_ref_log_prob":
        batch = batch.union(run.verl._compute_ref_log_prob(run.trainer, batch))
    mask = batch.batch["response_mask"]
    batch.batch["advantages"] = torch.linspace(-1, 1, len(mask))[:, None] * mask
    if damage == "nan_in_last_mini_batch":
        batch.batch["advantages"][-1, 0] = float("nan")  # row 8 of 8: the second mini-batch
    before = current_log_probs(run, batch)
    with pytest.raises(ValueError, match=message):
        run.verl._update_actor(run.trainer, batch)
    assert torch.equal(current_log_probs(run, batch), before)  # no optimizer step happened


def test_profile_window_writes_a_trace_of_what_ran_in_it(run, tmp_path):
    """verl's trainer brackets a ``global_profiler.steps`` step with these calls."""
    import json

    batch = data_proto(rollout(run.server, run.config))
    run.worker.profiler.save_path = tmp_path
    run.worker.start_profile(role="train", profile_step=3)
    current_log_probs(run, batch)  # the forwarder converts the batch and calls the engine
    run.worker.stop_profile(run_command=False)
    trace = tmp_path / f"arctic_forwarder_step3_train_rank{run.worker.rank}.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)
    run.worker.stop_profile()  # no window open: nothing to write
    assert [p.name for p in tmp_path.iterdir()] == [trace.name]
