"""LoRA on the output layer (``lora.train_unembed``, Tinker's ``train_unembed``, on by default
there): adapted where the output layer has its own weights, reported and left out where it shares
the input embedding's.

The untied model is ``builtin:tiny`` saved again with ``tie_word_embeddings: false`` (its head
then gets weights of its own); the weights a sampler receives are checked against the trainer's
own logits in a fresh plain model.
"""

from __future__ import annotations

import pytest
import torch

from arctic_platform.engine.builtin import builtin_model_path
from arctic_platform.engine.config import LoraConfig, ModelConfig, TrainingEngineConfig
from arctic_platform.engine.trainer import TrainingEngine
from arctic_platform.engine.weights import export_weights
from tests.engine.rl_batches import TINY, rl_batch

VERL = {"loss_fn": "verl_grpo"}


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = builtin_model_path(TINY.name)
    model = AutoModelForCausalLM.from_pretrained(source, tie_word_embeddings=False)
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    folder = tmp_path_factory.mktemp("untied")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return str(folder)


def lora_engine(model: str, train_unembed: bool) -> TrainingEngine:
    lora = LoraConfig(r=4, alpha=8.0, train_unembed=train_unembed)
    config = ModelConfig(name=model, device="cpu", lora=lora)
    return TrainingEngine(TrainingEngineConfig(model=config, seed=0))


def exported(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in export_weights(engine.model)}


def train_once(engine: TrainingEngine) -> None:
    engine.forward_backward(rl_batch(rows=4), None, VERL)
    engine.step(learning_rate=1e-2)


def test_train_unembed_adapts_an_untied_output_layer_and_the_sync_carries_it(untied):
    from transformers import AutoModelForCausalLM

    engine = lora_engine(untied, train_unembed=True)
    assert engine.setting_fallbacks == {}
    adapted = {n.split(".lora_A")[0] for n, _ in engine.model.named_parameters() if "lora_A" in n}
    assert any(n.endswith("lm_head") for n in adapted)
    assert any(n.endswith("q_proj") for n in adapted) and any(
        n.endswith("down_proj") for n in adapted
    )
    before = exported(engine)
    train_once(engine)
    after = exported(engine)
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    embed = "model.embed_tokens.weight"
    assert torch.equal(after[embed], before[embed])  # only adapters train
    # a sampler loading the exported weights computes the trainer's logits
    plain = AutoModelForCausalLM.from_pretrained(untied)
    plain.load_state_dict(after)
    ids = rl_batch(rows=2)["input_ids"]
    with torch.no_grad():
        want = engine.model(input_ids=ids).logits
        got = plain(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_train_unembed_the_output_layer_stays_as_it_was(untied):
    engine = lora_engine(untied, train_unembed=False)
    assert not any("lm_head.lora_A" in n for n, _ in engine.model.named_parameters())
    before = exported(engine)
    train_once(engine)
    assert torch.equal(exported(engine)["lm_head.weight"], before["lm_head.weight"])


def test_a_tied_output_layer_is_left_out_and_reported(caplog):
    with caplog.at_level("WARNING"):
        engine = lora_engine(TINY.name, train_unembed=True)
    why = engine.setting_fallbacks["lora.train_unembed"]
    assert "tie_word_embeddings" in why and why in caplog.text
    assert not any("lm_head.lora_A" in n for n, _ in engine.model.named_parameters())
    assert any("q_proj.lora_A" in n for n, _ in engine.model.named_parameters())
    train_once(engine)  # trains (and exports) as a LoRA model without it
    assert "lm_head.weight" not in exported(engine)  # tied: the embedding is the head
