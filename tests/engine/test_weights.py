"""Weight sync from a training model to the SamplingEngine: in process, as a chunk stream, LoRA.

The policy is changed by real training (plain torch AdamW on cross-entropy, high learning rate)
until its greedy continuation differs from the sampler's; the sampler must keep its old output
until the sync and produce the trainer's output right after it.
"""

import json
import struct

import pytest
import torch
from safetensors.torch import load as load_safetensors

from arctic_platform.engine.config import LoraConfig, ModelConfig, SamplingEngineConfig
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.sampler import SamplerStateError, SamplingEngine
from arctic_platform.engine.weights import (
    WeightLoadError,
    collect_weights,
    export_weights,
    iter_weights_from_chunks,
    snapshot_adapters,
    stream_weights,
    sync_in_process,
)

MODEL = ModelConfig(name="builtin:tiny")
PROMPT = "The answer is"
GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
TEXT = "The answer is 42. The answer is 42. The answer is 42."


@pytest.fixture(scope="module")
def sampler():
    return SamplingEngine(SamplingEngineConfig(model=MODEL))


@pytest.fixture(scope="module")
def trainer():
    return load_causal_lm(MODEL)


@pytest.fixture(scope="module")
def lora_trainer():
    return load_causal_lm(MODEL.model_copy(update={"lora": LoraConfig(r=4, alpha=8.0)}))


def _sample(sampler):
    return sampler.generate([PROMPT], GREEDY)[0]["token_ids"]


def _trainer_greedy(model, tokenizer):
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            do_sample=False,
            max_new_tokens=16,
            min_new_tokens=16,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def _train_until_greedy_differs(model, sampler, max_steps=60):
    """AdamW steps on fixed text until the model's greedy continuation leaves the sampler's."""
    before = _sample(sampler)
    text = torch.tensor([sampler.tokenizer(TEXT, add_special_tokens=False)["input_ids"]])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model.train()
    for _ in range(max_steps):
        model(input_ids=text, labels=text).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        after = _trainer_greedy(model, sampler.tokenizer)
        if after != before:
            return before, after
        model.train()
    raise AssertionError("training did not change the greedy output")


def _snapshot(sampler):
    return {k: v.clone() for k, v in sampler.model.state_dict().items()}


def _assert_unchanged(sampler, snapshot):
    for name, value in sampler.model.state_dict().items():
        assert torch.equal(value, snapshot[name]), name


def test_in_process_sync(sampler, trainer):
    before, after = _train_until_greedy_differs(trainer, sampler)
    assert _sample(sampler) == before  # training alone does not reach the sampler
    report = sync_in_process(trainer, sampler)
    assert report["complete"]
    assert _sample(sampler) == after
    for name, value in trainer.state_dict().items():
        assert torch.equal(sampler.model.state_dict()[name], value), name


def test_export_names_are_the_plain_model_names_with_tied_weights_once(trainer):
    names = [name for name, _ in export_weights(trainer)]
    assert sorted(names) == sorted(name for name, _ in trainer.named_parameters())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_collect_copies_unless_told_a_matching_tensor_may_be_kept():
    """The CUDA weight transfers send the trainer's own tensors where they already fit."""
    targets = {"norm": torch.zeros(3), "head": torch.zeros(2, dtype=torch.bfloat16)}
    weights = {"norm": torch.ones(3), "head": torch.ones(2)}
    copied, report = collect_weights(targets, weights)
    kept, _ = collect_weights(targets, weights, device=None, copy=False)
    assert report["complete"] and torch.equal(kept["norm"], copied["norm"])
    assert copied["norm"].data_ptr() != weights["norm"].data_ptr()
    assert kept["norm"].data_ptr() == weights["norm"].data_ptr()
    assert kept["head"].dtype == torch.bfloat16  # a dtype that differs is still converted


def test_chunked_stream_sync(sampler, trainer):
    before, after = _train_until_greedy_differs(trainer, sampler)
    chunk_bytes = 100_000
    chunks = list(stream_weights(trainer, chunk_bytes=chunk_bytes))
    assert len(chunks) > 10
    largest = max(p.numel() * p.element_size() for p in trainer.parameters())
    for blob in chunks:
        tensors = load_safetensors(blob)
        assert len(blob) <= chunk_bytes + 16_384 or len(tensors) == 1  # header slack
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= max(
            chunk_bytes, largest
        )
    assert max(len(load_safetensors(blob)) for blob in chunks) > 1  # several tensors per chunk
    assert _sample(sampler) == before
    report = sampler.load_weights(iter_weights_from_chunks(iter(chunks)))
    assert report["complete"] and report["tensors"] == len(list(trainer.parameters()))
    assert _sample(sampler) == after


def test_lora_sync_merges_adapters(sampler, lora_trainer):
    base = load_causal_lm(MODEL)
    sampler.load_weights(export_weights(base))  # the sampler starts from the LoRA model's base
    base_before = {k: v.clone() for k, v in lora_trainer.get_base_model().state_dict().items()}
    _, after = _train_until_greedy_differs(lora_trainer, sampler)
    exported = [name for name, _ in export_weights(lora_trainer)]
    assert not [n for n in exported if "lora" in n or "base_layer" in n]
    assert set(exported) | {"lm_head.weight"} == set(sampler.model.state_dict())
    sync_in_process(lora_trainer, sampler)
    assert _sample(sampler) == after
    ids = torch.tensor([sampler.tokenizer(TEXT, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        expected = lora_trainer(input_ids=ids).logits
        got = sampler.model(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    with torch.no_grad():
        assert (got - base(input_ids=ids).logits).abs().max() > 1e-2  # the merge is not a no-op
    # the training model is untouched: base weights as before the export, adapters still there
    changed = [
        k
        for k, v in lora_trainer.get_base_model().state_dict().items()
        if "lora_" not in k and not torch.equal(v, base_before[k])
    ]
    assert changed == []
    assert any("lora_B" in n for n, _ in lora_trainer.named_parameters())
    # the same merged weights travel through a stream
    sampler.load_weights(export_weights(base))  # back to the base weights
    assert _sample(sampler) != after
    sampler.load_weights(iter_weights_from_chunks(stream_weights(lora_trainer, chunk_bytes=50_000)))
    assert _sample(sampler) == after


def test_adapter_snapshot_exports_the_weights_of_its_time():
    """A snapshot of the adapters exports, merged, exactly what the live export gave at snapshot
    time (peft's own merge), and keeps doing so after the adapters move on."""
    model = load_causal_lm(MODEL.model_copy(update={"lora": LoraConfig(r=4, alpha=8.0)}))
    torch.manual_seed(0)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    with torch.no_grad():
        for p in lora:
            p.copy_(torch.randn_like(p) * 0.1)  # peft starts B at zero: make the delta real
    then = {n: t.clone() for n, t in export_weights(model)}
    snapshot = snapshot_adapters(model)
    assert {n: t for n, t in export_weights(model, adapters=snapshot)}.keys() == then.keys()
    for name, tensor in export_weights(model, adapters=snapshot):
        assert torch.equal(tensor, then[name]), name
    with torch.no_grad():
        for p in lora:
            p.add_(0.5)
    moved = dict(export_weights(model))
    assert any(not torch.equal(moved[n], then[n]) for n in then)
    for name, tensor in export_weights(model, adapters=snapshot):
        assert torch.equal(tensor, then[name]), name


def _module_with(name_path: str, shape):
    """A bare module whose only parameter has the given dotted name and shape."""
    root = torch.nn.Module()
    module = root
    *parents, leaf = name_path.split(".")
    for part in parents:
        child = torch.nn.Module()
        module.add_module(part, child)
        module = child
    module.register_parameter(leaf, torch.nn.Parameter(torch.ones(shape)))
    return root


@pytest.mark.parametrize(
    ("make_chunks", "field"),
    [
        (lambda t: [next(stream_weights(t, 100_000))[:-10]], "weights.chunk[0]"),
        (lambda t: [b"not safetensors at all"], "weights.chunk[0]"),
        (lambda t: [], "weights"),
        (
            lambda t: stream_weights(_module_with("model.unknown.weight", (4,))),
            "weights[model.unknown.weight]",
        ),
        (
            lambda t: stream_weights(_module_with("model.norm.weight", (3, 3))),
            "weights[model.norm.weight]",
        ),
    ],
    ids=["truncated", "garbage", "empty", "unknown-name", "shape-mismatch"],
)
def test_bad_streams_leave_the_sampler_unchanged(sampler, trainer, make_chunks, field):
    snapshot = _snapshot(sampler)
    with pytest.raises(WeightLoadError) as err:
        sampler.load_weights(iter_weights_from_chunks(make_chunks(trainer)))
    assert err.value.field == field and err.value.applied == 0
    _assert_unchanged(sampler, snapshot)
    sampler.generate([PROMPT], GREEDY)  # still serving


def test_bad_mapping_is_rejected_before_anything_is_written(sampler):
    snapshot = _snapshot(sampler)
    weights = dict(export_weights(sampler.model))
    weights = {name: torch.zeros_like(t) for name, t in weights.items()}
    weights["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(WeightLoadError) as err:
        sampler.load_weights(weights)
    assert err.value.field == "weights[model.norm.weight]" and err.value.applied == 0
    _assert_unchanged(sampler, snapshot)


def _restamp(blob: bytes, **changes) -> bytes:
    """Rewrite a chunk's stream header (to forge out-of-order or foreign chunks)."""
    tensors = load_safetensors(blob)
    (size,) = struct.unpack("<Q", blob[:8])
    metadata = json.loads(blob[8 : 8 + size])["__metadata__"]
    header = json.loads(metadata["arctic.weights"])
    header.update(changes)
    metadata["arctic.weights"] = json.dumps(header)
    from safetensors.torch import save

    return save(tensors, metadata=metadata)


@pytest.mark.parametrize("damage", ["truncated", "missing", "reordered", "foreign"])
def test_damage_mid_stream_blocks_generation_until_a_full_sync(sampler, trainer, damage):
    chunks = list(stream_weights(trainer, chunk_bytes=100_000))
    if damage == "truncated":
        chunks[3] = chunks[3][: len(chunks[3]) // 2]
    elif damage == "missing":
        del chunks[-1]
    elif damage == "reordered":
        chunks[2], chunks[3] = chunks[3], chunks[2]
    else:
        chunks[3] = _restamp(chunks[3], stream="another")
    with pytest.raises(WeightLoadError) as err:
        sampler.load_weights(iter_weights_from_chunks(chunks))
    assert err.value.applied > 0 and "already applied" in str(err.value)
    with pytest.raises(SamplerStateError):
        sampler.generate([PROMPT], GREEDY)
    sync_in_process(trainer, sampler)  # a complete load restores service
    assert _sample(sampler) == _trainer_greedy(trainer, sampler.tokenizer)


def test_a_tensor_larger_than_the_chunk_travels_alone(trainer):
    chunk_bytes = 40_000  # the 102 x 128 float32 embedding is 52 KB
    chunks = [load_safetensors(blob) for blob in stream_weights(trainer, chunk_bytes)]
    big = [c for c in chunks if any(t.numel() * t.element_size() > chunk_bytes for t in c.values())]
    assert big and all(len(c) == 1 for c in big)
    assert any(len(c) > 1 for c in chunks)
    names = [name for c in chunks for name in c]
    assert sorted(names) == sorted(name for name, _ in trainer.named_parameters())


def test_a_stream_is_consumed_once(trainer):
    stream = iter_weights_from_chunks(stream_weights(trainer, chunk_bytes=1_000_000))
    assert len(list(stream)) == len(list(trainer.parameters()))
    with pytest.raises(RuntimeError):
        list(stream)


def test_lora_variants_are_refused_rather_than_merged_wrongly():
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    dora = get_peft_model(
        load_causal_lm(MODEL), PeftLoraConfig(r=2, use_dora=True, target_modules=["q_proj"])
    )
    with pytest.raises(TypeError, match="DoRA"):
        export_weights(dora)
