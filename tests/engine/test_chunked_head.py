"""The chunked LM head: every loss, log-prob, entropy and top-k equal to the whole-logits path.

Each case runs the same batch through two engines on ``builtin:tiny``: one with
``logits.optimization: none`` (today's path: the model's whole logits through autograd) and one
whose budget forces chunks of :data:`CHUNK` rows, so every microbatch goes through the head in
several chunks, forward and backward. Values (loss, metrics, log-probs, entropies) and the
gradients of every parameter (the tied embedding / LM head included) must agree to float
rounding, for every registered loss, with prompt sharing on and off, with entropy on and off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from arctic_platform.engine import chunked_head
from arctic_platform.engine.chunked_head import CHUNK_BUFFERS, FLOAT32_BYTES, LMHead
from arctic_platform.engine.config import (
    LogitsSettings,
    LoraConfig,
    ModelConfig,
    SamplingEngineConfig,
)
from arctic_platform.engine.forward import prepare_training_request
from arctic_platform.engine.logprob_engine import LogProbEngine
from arctic_platform.engine.losses import LOSSES
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.prompt_sharing import SAVED_METRIC
from arctic_platform.engine.trainer import TrainingEngine
from tests.engine.rl_batches import TINY, engine_config, shared_prompt_batch

CHUNK = 7  # rows per chunk: every microbatch below spans several
# Prompts sampled (n, prompt length): two shared, one alone; responses are 1..6 tokens.
GROUPS = [(3, 14), (1, 5), (2, 9)]
TIGHT = {"rtol": 1e-5, "atol": 1e-6}


def budget_for(rows: int, vocab: int) -> LogitsSettings:
    """Settings whose chunks hold ``rows`` rows of a ``vocab``-token head."""
    gib = rows * vocab * FLOAT32_BYTES * CHUNK_BUFFERS / 2**30
    return LogitsSettings(optimization="memory", peak_mem_size_in_gib=gib)


VOCAB = int(load_causal_lm(TINY).get_output_embeddings().out_features)
CHUNKED = budget_for(CHUNK, VOCAB)
WHOLE = LogitsSettings(optimization="none")


def echo_batch() -> dict[str, np.ndarray]:
    """The shared-prompt batch, plus ECHO's masks on each prompt's last tokens (observation: the
    last two, target: the last one), disjoint from the responses."""
    batch = shared_prompt_batch(groups=GROUPS)
    mask = batch["attention_mask"].astype(bool)
    width = batch["prompts"].shape[1]
    obs = np.zeros_like(mask)
    sft = np.zeros_like(mask)
    for row in range(mask.shape[0]):
        cols = np.flatnonzero(mask[row, :width])
        obs[row, cols[-2:]] = True
        sft[row, cols[-1]] = True
    return {**batch, "echo_observation_mask": obs, "sft_mask": sft}


# One configuration per registered loss; the entropy variant adds an entropy term where the loss
# has one, so the entropy's gradient goes through the head too.
LOSS_CASES = {
    "verl_grpo": ({"actor_config": {"use_kl_loss": True, "kl_loss_coef": 0.1}}, {}),
    "grpo": ({}, {"use_kl_loss": True, "kl_loss_coef": 0.1}),
    "grpo_echo_v1": ({}, {"aux_ce_weight": 0.5, "echo_global_num_sequences": 16}),
    "ppo": ({}, {}),
    "importance_sampling": ({}, {}),
    "cispo": ({}, {}),
    "dro": ({}, {"beta": 0.1}),
    "cross_entropy": ({}, {}),
}


def test_every_registered_loss_has_a_case():
    assert set(LOSS_CASES) == set(LOSSES)


@pytest.fixture(scope="module")
def batch():
    return shared_prompt_batch(groups=GROUPS)


@pytest.fixture(scope="module")
def batch_with_echo_masks():
    return echo_batch()


@pytest.fixture(scope="module")
def engines():
    """``(chunked, whole)`` engine pairs by prompt sharing; each case drops their gradients."""
    return {
        sharing: tuple(
            TrainingEngine(
                engine_config(max_tokens_per_microbatch=60, prompt_sharing=sharing, logits=logits)
            )
            for logits in (CHUNKED, WHOLE)
        )
        for sharing in ("auto", "off")
    }


@pytest.fixture
def chunk_calls(monkeypatch):
    """How many chunks' logits the head computed (forward and backward)."""
    calls = []
    real = chunked_head._chunk_logits

    def counting(rows, *args):
        calls.append(rows.shape[0])
        return real(rows, *args)

    monkeypatch.setattr(chunked_head, "_chunk_logits", counting)
    return calls


def grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, want: dict) -> None:
    """Equal to float32 rounding: relative to each gradient's largest element, as sums over a
    batch's tokens in a different order round."""
    assert got.keys() == want.keys()
    for name, value in want.items():
        scale = float(value.abs().max())
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5 * scale, msg=name)


def kinds(engine: TrainingEngine, batch) -> set[str]:
    request = prepare_training_request(
        batch, None, None, engine.config, model=engine, backward=False
    )
    return {type(mb).__name__ for mb in request.plan}


@pytest.mark.slow  # 32 cases, seconds each
@pytest.mark.parametrize("entropy", [False, True], ids=["no-entropy", "entropy"])
@pytest.mark.parametrize("sharing", ["auto", "off"])
@pytest.mark.parametrize("loss", sorted(LOSS_CASES))
def test_loss_metrics_logprobs_and_every_gradient_equal_whole_logits(
    engines, batch, batch_with_echo_masks, chunk_calls, loss, sharing, entropy
):
    chunked, whole = engines[sharing]
    if loss == "grpo_echo_v1":  # the masks it reads; the other losses refuse them
        batch = batch_with_echo_masks
    assert ("SharedMicroBatch" in kinds(chunked, batch)) == (sharing == "auto")
    meta, config = LOSS_CASES[loss]
    meta = {**meta, "calculate_entropy": entropy, "temperature": 0.8}
    if entropy and loss == "verl_grpo":
        meta["actor_config"] = {**meta["actor_config"], "entropy_coeff": 0.05}
    processing = {"loss_fn": loss, "config": config}
    results = []
    for engine in (chunked, whole):
        engine.optimizer.zero_grad(set_to_none=True)
        out = engine.forward_backward(batch, meta, processing)
        results.append((out, grads(engine)))
    (got, got_grads), (want, want_grads) = results
    assert chunk_calls and max(chunk_calls) == CHUNK
    assert len(chunk_calls) >= 4  # several chunks, each forward and again in backward
    assert got["metrics"].keys() == want["metrics"].keys()
    for name, value in want["metrics"].items():
        if name != SAVED_METRIC:
            assert got["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert "model.embed_tokens.weight" in got_grads  # the tied LM head
    assert got_grads["model.embed_tokens.weight"].abs().sum() > 0
    assert_grads_close(got_grads, want_grads)


def test_a_backward_pass_scores_only_the_positions_its_loss_reads(engines, batch, chunk_calls):
    """Without log-probs returned, the head computes the response tokens' positions (forward
    and again in backward) and nothing else; asked for log-probs, every position."""
    chunked, whole = engines["off"]
    responses = int(batch["response_mask"].sum())
    scored = int(batch["attention_mask"].sum()) - len(batch["input_ids"])  # all but first tokens
    chunked.forward_backward(batch)
    assert sum(chunk_calls) == 2 * responses < scored
    chunk_calls.clear()
    for engine in (chunked, whole):
        engine.optimizer.zero_grad(set_to_none=True)
    got = chunked.forward_backward(batch, with_logprobs=True)
    want = whole.forward_backward(batch, with_logprobs=True)
    assert sum(chunk_calls) == 2 * scored
    torch.testing.assert_close(got["logprobs"], want["logprobs"], **TIGHT)
    assert_grads_close(grads(chunked), grads(whole))


@pytest.mark.parametrize("sharing", ["auto", "off"])
def test_forward_logprobs_and_entropy_equal_whole_logits(engines, batch, chunk_calls, sharing):
    chunked, whole = engines[sharing]
    meta = {"calculate_entropy": True, "temperature": 0.7}
    got, want = chunked.forward(batch, meta), whole.forward(batch, meta)
    assert chunk_calls
    torch.testing.assert_close(got["logprobs"], want["logprobs"], **TIGHT)
    torch.testing.assert_close(got["entropy"], want["entropy"], **TIGHT)


def test_post_processors_in_any_order_equal_whole_logits(engines, batch):
    """Log-probs before the temperature step see unscaled logits on both paths."""
    chunked, whole = engines["off"]
    processing = {"post": ["compute_logprobs", "apply_temperature"]}
    meta = {"temperature": 0.5}
    got, want = chunked.forward(batch, meta, processing), whole.forward(batch, meta, processing)
    torch.testing.assert_close(got["logprobs"], want["logprobs"], **TIGHT)
    plain = whole.forward(batch, {"temperature": 1.0}, processing)
    torch.testing.assert_close(got["logprobs"], plain["logprobs"], **TIGHT)


def test_log_probs_op_top_k_equal_whole_logits(chunk_calls):
    prompts = [[5, 17, 33, 40, 41, 60, 2, 9, 11], [7, 8, 9, 10, 12, 30]]
    completions = [[3, 4, 50], [90, 91]]
    chunked = LogProbEngine(SamplingEngineConfig(model=TINY, logits=CHUNKED))
    whole = LogProbEngine(SamplingEngineConfig(model=TINY, logits=WHOLE))
    got = chunked.log_probs(prompts, completions, top_k=5)
    want = whole.log_probs(prompts, completions, top_k=5)
    assert chunk_calls
    for mine, theirs in zip(got, want, strict=True):
        assert mine["logprobs"] == pytest.approx(theirs["logprobs"], rel=1e-5, abs=1e-6)
        for top_mine, top_theirs in zip(mine["top_logprobs"], theirs["top_logprobs"], strict=True):
            assert [t for t, _ in top_mine] == [t for t, _ in top_theirs]
            assert [v for _, v in top_mine] == pytest.approx(
                [v for _, v in top_theirs], rel=1e-5, abs=1e-6
            )


@pytest.mark.slow
def test_lora_gradients_equal_whole_logits(batch, chunk_calls):
    model = ModelConfig(name="builtin:tiny", lora=LoraConfig(r=4, alpha=8))
    got, want = (
        TrainingEngine(engine_config(model=model, logits=logits)) for logits in (CHUNKED, WHOLE)
    )
    meta = {"calculate_entropy": True, "actor_config": {"entropy_coeff": 0.05}}
    got.forward_backward(batch, meta)
    want.forward_backward(batch, meta)
    assert chunk_calls
    lora = grads(got)
    assert lora and all("lora_" in name for name in lora)
    assert_grads_close(lora, grads(want))


@pytest.mark.slow
def test_gradient_checkpointing_gradients_equal_whole_logits(batch, chunk_calls):
    got, want = (
        TrainingEngine(engine_config(gradient_checkpointing=True, logits=logits))
        for logits in (CHUNKED, WHOLE)
    )
    got.forward_backward(batch)
    want.forward_backward(batch)
    assert chunk_calls
    assert_grads_close(grads(got), grads(want))


def test_chunks_come_from_the_budget_and_the_vocabulary():
    """SkyRL's 4 GiB over Qwen3's vocabulary, and the default 0.5 GiB."""
    head = torch.nn.Linear(8, 151_936, bias=False, device="meta")
    skyrl = LMHead(head, LogitsSettings(peak_mem_size_in_gib=4.0).peak_bytes)
    assert skyrl.chunk_rows == 4 * 2**30 // (151_936 * FLOAT32_BYTES * CHUNK_BUFFERS) == 3533
    default = LMHead(head, LogitsSettings().peak_bytes)
    assert default.chunk_rows == 441
    assert default.chunks(8 * 384) and not default.chunks(200)  # 8 rows x 384 tokens: chunked
    tiny = LMHead(torch.nn.Linear(8, VOCAB, device="meta"), LogitsSettings().peak_bytes)
    assert not tiny.chunks(16_384)  # a small vocabulary keeps whole logits by default


def test_whole_logits_when_asked_or_when_the_model_scales_its_logits():
    model = load_causal_lm(TINY)
    assert LMHead.of(model, WHOLE) is None
    assert isinstance(LMHead.of(model, CHUNKED), LMHead)
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=30.0,
    )
    capped = Gemma2ForCausalLM(config)
    assert LMHead.of(capped, CHUNKED) is None  # chunks would skip its soft-capping
    capped.config.final_logit_softcapping = None
    assert isinstance(LMHead.of(capped, CHUNKED), LMHead)
