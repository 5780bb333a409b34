"""Weight sync into the vLLM engine: after every sync, generation equals a fresh engine's.

A real trainer (our TrainingEngine, AdamW on cross-entropy at a high learning rate) changes the
policy; its weights reach the vLLM engine through the same ``sync_in_process`` the server's
weight-sync op uses. The engine's greedy tokens and log-probs must then equal those of a vLLM
engine started fresh on the trainer's saved weights (and our sampler synced the same way), for
``reload`` (what ``auto`` is on CPU: vLLM's reload re-packs the layers it loads into its CPU
kernels' layout, and the worker re-packs the tied LM head reload leaves alone) and ``restart``;
seeded samples at temperature 1 equal the fresh engine's too. Bad syncs are refused before the
vLLM process sees them, and the engine keeps serving the previous weights.
"""

from __future__ import annotations

import pytest
import torch

from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig, TrainingEngineConfig
from arctic_platform.engine.models import load_tokenizer
from arctic_platform.engine.sampler import SamplingEngine
from arctic_platform.engine.trainer import TrainingEngine
from arctic_platform.engine.vllm_backend.engine import VllmSamplingEngine
from arctic_platform.engine.weights import WeightLoadError, export_weights, sync_in_process
from arctic_platform.layout import training_batch
from tests.vllm.conftest import (
    assert_same_generation,
    greedy_tokens_and_logprobs,
    needs_vllm,
    sampled_tokens_and_logprobs,
    save_model_dir,
    vllm_config,
)

pytestmark = [needs_vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def trainer(perturbed_model_dir):
    config = TrainingEngineConfig(model=ModelConfig(name=perturbed_model_dir))
    return TrainingEngine(config)


@pytest.fixture(scope="module")
def engine(perturbed_model_dir):
    engine = VllmSamplingEngine(vllm_config(perturbed_model_dir))
    yield engine
    engine.close()


def assert_same_sampling(a, b) -> None:
    assert_same_generation(sampled_tokens_and_logprobs(a), sampled_tokens_and_logprobs(b))


def _train_step(trainer: TrainingEngine) -> None:
    """One optimizer step of cross-entropy on fixed text, large enough to move greedy output."""
    tokenizer = load_tokenizer(trainer.config.model)
    ids = tokenizer("The answer is 42. " * 3, add_special_tokens=False)["input_ids"]
    batch = training_batch([ids[:4]], [ids[4:]], pad_token_id=0)
    trainer.forward_backward(batch, processing={"loss_fn": "cross_entropy"})
    trainer.step(5e-2)


def test_sync_after_training_equals_a_fresh_engine(engine, trainer, tmp_path):
    before = greedy_tokens_and_logprobs(engine)
    _train_step(trainer)
    assert_same_generation(greedy_tokens_and_logprobs(engine), before)
    report = sync_in_process(trainer.model, engine)
    assert report["complete"] and report["method"] == "reload"  # ``auto`` on CPU
    synced = greedy_tokens_and_logprobs(engine)
    assert synced[0] != before[0]  # the step changed the policy, so the test can fail

    weights_dir = save_model_dir(trainer.model, tmp_path / "step1")
    fresh = VllmSamplingEngine(vllm_config(weights_dir, weight_sync="restart"))
    try:
        assert_same_generation(synced, greedy_tokens_and_logprobs(fresh))
        assert_same_sampling(engine, fresh)
        ours = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name=weights_dir)))
        assert_same_generation(synced, greedy_tokens_and_logprobs(ours))

        # A second step, synced by restart into the fresh engine and by reload into the first.
        _train_step(trainer)
        assert sync_in_process(trainer.model, fresh)["method"] == "restart"
        sync_in_process(trainer.model, engine)
        sync_in_process(trainer.model, ours)
        reloaded = greedy_tokens_and_logprobs(engine)
        assert reloaded[0] != synced[0]
        assert_same_generation(reloaded, greedy_tokens_and_logprobs(fresh))
        assert_same_sampling(engine, fresh)
        assert_same_generation(reloaded, greedy_tokens_and_logprobs(ours))
    finally:
        fresh.close()


def test_partial_sync_keeps_the_other_weights(engine, trainer):
    exported = dict(export_weights(trainer.model))
    before = greedy_tokens_and_logprobs(engine)
    name = "model.layers.0.mlp.down_proj.weight"
    report = engine.load_weights({name: exported[name]})
    assert report["tensors"] == 1 and not report["complete"]
    # The same value: nothing else moved.
    assert_same_generation(greedy_tokens_and_logprobs(engine), before)
    report = engine.load_weights({name: torch.zeros_like(exported[name])})
    assert greedy_tokens_and_logprobs(engine)[0] != before[0]
    engine.load_weights({name: exported[name]})
    assert_same_generation(greedy_tokens_and_logprobs(engine), before)


@pytest.mark.parametrize(
    ("weights", "field", "message"),
    [
        ({"model.nope.weight": torch.zeros(2)}, "weights[model.nope.weight]", "no such tensor"),
        (
            {"model.norm.weight": torch.zeros(3)},
            "weights[model.norm.weight]",
            "does not match the model's",
        ),
        ({"model.norm.weight": "zeros"}, "weights[model.norm.weight]", "expected a tensor"),
    ],
)
def test_bad_syncs_are_refused_and_change_nothing(engine, weights, field, message):
    before = greedy_tokens_and_logprobs(engine)
    with pytest.raises(WeightLoadError, match=message) as info:
        engine.load_weights(weights)
    assert info.value.field == field
    assert_same_generation(greedy_tokens_and_logprobs(engine), before)
