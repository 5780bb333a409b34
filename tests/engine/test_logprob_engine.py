"""LogProbEngine: the frozen reference model behind fwd_no_grad(reference) and log-probs."""

from __future__ import annotations

import pytest
import torch

from arctic_platform.engine.config import SamplingEngineConfig
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.logprob_engine import LogProbEngine
from arctic_platform.engine.trainer import TrainingEngine
from tests.engine.rl_batches import TINY, engine_config, rl_batch


@pytest.fixture(scope="module")
def engine():
    return LogProbEngine(SamplingEngineConfig(model=TINY, max_tokens_per_microbatch=32))


def direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    """``log p(ids[k] | ids[:k])`` for k >= 1, from one plain HF call."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), -1)


def test_model_is_frozen(engine):
    assert not engine.model.training
    assert not any(p.requires_grad for p in engine.model.parameters())
    bare = LogProbEngine(TINY)  # a bare ModelConfig works too
    assert bare.max_model_len == 1024  # the model's max_position_embeddings
    assert not any(p.requires_grad for p in bare.model.parameters())


def test_forward_equals_the_training_engine_bitwise(engine):
    trainer = TrainingEngine(engine_config(max_tokens_per_microbatch=32))
    batch = rl_batch(rows=6, seed=8)
    processing = {"post": ["compute_entropy_and_logprobs"]}
    mine = engine.forward(batch, {"calculate_entropy": True}, processing)
    theirs = trainer.forward(batch, {"calculate_entropy": True}, processing)
    assert torch.equal(mine["logprobs"], theirs["logprobs"])
    assert torch.equal(mine["entropy"], theirs["entropy"])


def test_log_probs_of_completions_with_top_k(engine):
    prompts = [[10, 11, 12, 13], "Hi"]
    completions = [[20, 21, 22], " there"]
    out = engine.log_probs(prompts, completions, top_k=3)
    assert out[1]["prompt_token_ids"] == engine.tokenizer("Hi")["input_ids"]
    assert (
        out[1]["completion_token_ids"]
        == engine.tokenizer(" there", add_special_tokens=False)["input_ids"]
    )
    for item in out:
        ids = item["prompt_token_ids"] + item["completion_token_ids"]
        logp = direct_logprobs(engine.model, ids)
        start = len(item["prompt_token_ids"])
        assert len(item["logprobs"]) == len(item["top_logprobs"]) == len(ids) - start
        for n, k in enumerate(range(start, len(ids))):
            assert item["logprobs"][n] == pytest.approx(logp[k - 1, ids[k]].item(), abs=1e-5)
            values, tokens = torch.topk(logp[k - 1], 3)
            top = item["top_logprobs"][n]
            assert [t for t, _ in top] == tokens.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)


def test_prompt_scoring_has_none_for_the_first_token(engine):
    (item,) = engine.log_probs([[5, 6, 7, 8]], top_k=0)
    logp = direct_logprobs(engine.model, [5, 6, 7, 8])
    assert item["completion_token_ids"] == []
    assert item["logprobs"][0] is None and item["top_logprobs"][0] is None
    assert item["logprobs"][1:] == pytest.approx(
        [logp[k - 1, t].item() for k, t in ((1, 6), (2, 7), (3, 8))], abs=1e-5
    )
    assert item["top_logprobs"][1:] == [[], [], []]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("hello",), "prompts"),
        (([],), "prompts"),
        (([[1, 2]], [[3], [4]]), "completions"),
        (([[1, 2], [1, 500]],), "prompts[1]"),
        (([[1, 2], [1.5]],), "prompts[1]"),
        (([[]],), "prompts[0]"),
        (([[1] * 1000], [[2] * 100]), "prompts[0]"),
        (([[1, 2]], None, -1), "top_k"),
    ],
)
def test_bad_requests_name_the_field(engine, args, field):
    with pytest.raises(EngineInputError) as info:
        engine.log_probs(*args)
    assert info.value.field == field
