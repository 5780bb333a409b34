"""Tinker datums of one GRPO group share their prompt in the engine, and nothing changes for it.

A Tinker datum does not mark its prompt; ``build_batch`` finds it from the loss inputs (zeros over
the prompt) so the engine's prompt sharing runs each prompt once. Every test scores the batch
twice, with sharing (checking the plan really shares) and with ``prompt_sharing: off``, and
compares what a Tinker client gets (per-datum log-probs, ``loss:sum``) and every gradient (up
to float rounding: token sums here reach the hundreds).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arctic_platform.engine.forward import prepare_training_request
from arctic_platform.engine.prompt_sharing import SAVED_METRIC
from arctic_platform.engine.trainer import TrainingEngine
from arctic_platform.server.tinker import losses
from arctic_platform.server.tinker.codec import Datum
from tests.engine.rl_batches import engine_config

# (prompt length, response lengths of the group's samples)
GROUPS = [(14, [5, 3, 6, 2]), (9, [4, 4, 1]), (20, [3, 5])]


def cookbook_data(loss: str, *, prompt_inputs: float = 0.0) -> list[Datum]:
    """Datums as the cookbook builds them: ``model_input = prompt + response[:-1]``, targets
    shifted by one, zeros over the prompt (``prompt_inputs`` fills the prompt instead)."""
    rng = np.random.default_rng(0)
    data = []
    for prompt_len, responses in GROUPS:
        prompt = rng.integers(5, 100, prompt_len).tolist()
        for length in responses:
            response = rng.integers(5, 100, length).tolist()
            tokens = prompt + response[:-1]
            pad = [prompt_inputs] * (prompt_len - 1)
            if loss == "cross_entropy":
                inputs = {"weights": pad + [1.0] * length}
            else:
                inputs = {
                    "logprobs": pad + (rng.normal(-4.0, 0.3, length)).tolist(),
                    "advantages": pad + [float(rng.normal())] * length,
                }
            inputs["target_tokens"] = prompt[1:] + response
            data.append(
                Datum(
                    tokens=np.asarray(tokens, np.int64),
                    inputs={
                        k: np.asarray(v, np.int64 if k == "target_tokens" else np.float32)
                        for k, v in inputs.items()
                    },
                )
            )
    return data


def shares(engine: TrainingEngine, batch) -> bool:
    request = prepare_training_request(
        batch, None, None, engine.config, model=engine, backward=False
    )
    return any(type(mb).__name__ == "SharedMicroBatch" for mb in request.plan)


def run(engine: TrainingEngine, data: list[Datum], loss: str, config: dict) -> dict:
    batch = losses.build_batch(data, losses.check_loss(loss, config))
    out = engine.forward_backward(
        batch, None, losses.processing_for(loss, config), with_logprobs=True
    )
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
    return {
        "logprobs": losses.per_datum(out["logprobs"], [d.tokens.size for d in data]),
        "loss": losses.loss_metrics(out["metric_sums"])["loss:sum"],
        "grads": grads,
        "saved": out["metrics"][SAVED_METRIC],
    }


@pytest.fixture(scope="module")
def engines():
    return TrainingEngine(engine_config()), TrainingEngine(engine_config(prompt_sharing="off"))


@pytest.mark.parametrize(
    ("loss", "config"),
    [("importance_sampling", {}), ("dro", {"beta": 0.1}), ("cross_entropy", {})],
)
def test_a_groups_prompt_runs_once_with_the_unshared_results(engines, loss, config):
    shared, naive = engines
    data = cookbook_data(loss)
    assert shares(shared, losses.build_batch(data, losses.check_loss(loss, config)))
    for engine in engines:
        engine.model.zero_grad(set_to_none=True)
    got, want = run(shared, data, loss, config), run(naive, data, loss, config)
    assert got["saved"] > 0 and want["saved"] == 0
    for mine, theirs in zip(got["logprobs"], want["logprobs"], strict=True):
        np.testing.assert_allclose(mine["logprobs"], theirs["logprobs"], rtol=1e-5, atol=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():  # equal up to float rounding of the sums
        scale = float(grad.abs().max())
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-5 * scale)


def test_prompt_inputs_that_are_not_zero_only_stop_the_sharing():
    """A datum whose prompt carries nonzero inputs (DRO's penalty still scores it) is not split
    at a made-up point: its response mask starts at its first position."""
    data = cookbook_data("importance_sampling", prompt_inputs=-0.5)
    batch = losses.build_batch(data, losses.check_loss("importance_sampling", {}))
    first = [int(np.argmax(row)) for row in batch["response_mask"]]
    assert first == [1] * len(data)  # position 0 has no target, so no input
    assert (batch["response_mask"] <= batch["attention_mask"]).all()
