"""Weight sync into the vLLM engine: after every sync, generation equals a fresh engine's.

A real trainer (our TrainingEngine, AdamW on cross-entropy at a high learning rate) changes the
policy; its weights reach the vLLM engine through the same ``sync_in_process`` the server's
weight-sync op uses. The engine's greedy tokens and log-probs must then equal those of a vLLM
engine started fresh on the trainer's saved weights (and our sampler synced the same way), for
``restart`` (the CPU default) and ``reload``. Bad syncs are refused before the vLLM process sees
them, and the engine keeps serving the previous weights.
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
from tests.vllm.conftest import needs_vllm, save_model_dir, vllm_config

pytestmark = [needs_vllm, pytest.mark.slow]

PROMPTS = ["hello world", "The cat", "1+1=", [40, 41, 42, 43]]
GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, "logprobs": 0}


@pytest.fixture(scope="module")
def trainer(perturbed_model_dir):
    config = TrainingEngineConfig(model=ModelConfig(name=perturbed_model_dir))
    return TrainingEngine(config)


@pytest.fixture(scope="module")
def engine(perturbed_model_dir):
    engine = VllmSamplingEngine(vllm_config(perturbed_model_dir))
    yield engine
    engine.close()


def _train_step(trainer: TrainingEngine) -> None:
    """One optimizer step of cross-entropy on fixed text, large enough to move greedy output."""
    tokenizer = load_tokenizer(trainer.config.model)
    ids = tokenizer("The answer is 42. " * 3, add_special_tokens=False)["input_ids"]
    batch = training_batch([ids[:4]], [ids[4:]], pad_token_id=0)
    trainer.forward_backward(batch, processing={"loss_fn": "cross_entropy"})
    trainer.step(5e-2)


def _tokens_and_logprobs(engine) -> tuple[list, torch.Tensor]:
    outputs = engine.generate(PROMPTS, GREEDY)
    logprobs = [step["logprob"] for o in outputs for step in o["logprobs"]]
    return [o["token_ids"] for o in outputs], torch.tensor(logprobs)


def _assert_same(a, b) -> None:
    assert a[0] == b[0]
    assert torch.allclose(a[1], b[1], atol=1e-5)


def test_sync_after_training_equals_a_fresh_engine(engine, trainer, tmp_path):
    before = _tokens_and_logprobs(engine)
    _train_step(trainer)
    _assert_same(_tokens_and_logprobs(engine), before)
    report = sync_in_process(trainer.model, engine)
    assert report["complete"] and report["method"] == "restart"
    synced = _tokens_and_logprobs(engine)
    assert synced[0] != before[0]  # the step changed the policy, so the test can fail

    weights_dir = save_model_dir(trainer.model, tmp_path / "step1")
    fresh = VllmSamplingEngine(vllm_config(weights_dir, weight_sync="reload"))
    try:
        _assert_same(synced, _tokens_and_logprobs(fresh))
        ours = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name=weights_dir)))
        _assert_same(synced, _tokens_and_logprobs(ours))

        # A second step, synced by reload into the fresh engine and by restart into the first.
        _train_step(trainer)
        assert sync_in_process(trainer.model, fresh)["method"] == "reload"
        sync_in_process(trainer.model, engine)
        sync_in_process(trainer.model, ours)
        reloaded = _tokens_and_logprobs(fresh)
        assert reloaded[0] != synced[0]
        _assert_same(reloaded, _tokens_and_logprobs(engine))
        _assert_same(reloaded, _tokens_and_logprobs(ours))
    finally:
        fresh.close()


def test_partial_sync_keeps_the_other_weights(engine, trainer):
    exported = dict(export_weights(trainer.model))
    before = _tokens_and_logprobs(engine)
    name = "model.layers.0.mlp.down_proj.weight"
    report = engine.load_weights({name: exported[name]})
    assert report["tensors"] == 1 and not report["complete"]
    _assert_same(_tokens_and_logprobs(engine), before)  # the same value: nothing else moved
    report = engine.load_weights({name: torch.zeros_like(exported[name])})
    assert _tokens_and_logprobs(engine)[0] != before[0]
    engine.load_weights({name: exported[name]})
    _assert_same(_tokens_and_logprobs(engine), before)


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
    before = _tokens_and_logprobs(engine)
    with pytest.raises(WeightLoadError, match=message) as info:
        engine.load_weights(weights)
    assert info.value.field == field
    _assert_same(_tokens_and_logprobs(engine), before)
