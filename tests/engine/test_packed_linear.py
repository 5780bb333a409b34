"""Packed CPU linear layers (``engine/packed_linear.py``): against ``F.linear`` and autograd, after
the weight changes, and through the sampler against transformers' ``generate``.

The built-in tiny model's weights are below ``MIN_ELEMENTS``, so the sampler tests use
``builtin:small`` (512-wide, 8 layers), perturbed (``tests/perturbed.py``) so that greedy
continuations vary."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from arctic_platform.engine import packed_linear
from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.packed_linear import (
    FIRST_ROW,
    FIRST_ROW_LARGE,
    LAST_ROW,
    MIN_ELEMENTS,
    PackedLinear,
)
from arctic_platform.engine.sampler import SamplingEngine
from arctic_platform.engine.weights import export_weights, load_into_model
from tests.perturbed import perturbed

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="no oneDNN in this torch")


def _routed(out_features: int, in_features: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)
    assert packed_linear.install(nn.Sequential(layer)) == 1
    assert isinstance(layer.forward, PackedLinear)
    return layer


def _packed(layer: nn.Linear) -> bool:
    return layer.forward._packed is not None


def _assert_rounding_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to float rounding: oneDNN sums a product's terms in another order than MKL."""
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1536, 512, False), (512, 1536, True), (512, 512, False)])
@pytest.mark.parametrize("rows", [FIRST_ROW, 37, LAST_ROW])
@pytest.mark.parametrize("layout", ["decode", "prefill"])
def test_products_of_packed_sizes_equal_f_linear(shape, rows, layout):
    layer = _routed(*shape)
    x = torch.randn(rows, 1, shape[1]) if layout == "decode" else torch.randn(1, rows, shape[1])
    with torch.inference_mode():
        out = layer(x)
    assert _packed(layer)
    assert out.shape == (*x.shape[:-1], shape[0])
    _assert_rounding_close(out, F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("rows", [1, 8, FIRST_ROW - 1, LAST_ROW + 1, 1024])
def test_other_row_counts_take_f_linear(rows):
    layer = _routed(1536, 512)
    x = torch.randn(rows, 512)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert not _packed(layer)


@pytest.mark.parametrize("rows", [FIRST_ROW_LARGE - 1, FIRST_ROW_LARGE, FIRST_ROW - 1])
def test_weights_of_2048_x_1024_or_more_take_the_copy_from_4_rows(rows):
    layer = _routed(2048, 1024)
    x = torch.randn(rows, 1, 1024)
    with torch.inference_mode():
        out = layer(x)
    assert _packed(layer) == (rows >= FIRST_ROW_LARGE)
    _assert_rounding_close(out, F.linear(x, layer.weight))


def test_small_and_non_float32_weights_are_left_alone():
    small = nn.Linear(128, 128)
    half = nn.Linear(512, 512).to(torch.bfloat16)
    assert small.weight.numel() < MIN_ELEMENTS
    assert packed_linear.install(nn.Sequential(small, half)) == 0
    assert not isinstance(small.forward, PackedLinear)


def test_a_trainable_bias_alone_takes_f_linear_and_gets_its_gradient():
    layer = _routed(512, 512, bias=True)
    layer.bias.requires_grad_(True)
    layer(torch.randn(32, 512)).sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((512,), 32.0))
    assert not _packed(layer)


def test_refresh_packs_again_after_a_write_the_version_counter_misses():
    layer = _routed(1536, 512)
    x = torch.randn(FIRST_ROW, 512)
    with torch.no_grad():
        layer(x)
        new = torch.randn_like(layer.weight) / 512**0.5
        layer.weight.data.copy_(new)  # .data has its own version counter
        packed_linear.refresh(nn.Sequential(layer))
        _assert_rounding_close(layer(x), F.linear(x, new))


def test_bypassed_calls_take_f_linear_exactly():
    layer = _routed(1536, 512)
    x = torch.randn(FIRST_ROW, 512)
    with torch.no_grad(), packed_linear.bypassed():
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert not _packed(layer)


def test_a_copy_of_a_packed_layer_computes_and_packs_its_own():
    layer = _routed(1536, 512)
    x = torch.randn(FIRST_ROW, 512)
    with torch.no_grad():
        layer(x)
        twin = copy.deepcopy(layer)
        assert not _packed(twin) and twin.forward.module is twin
        _assert_rounding_close(twin(x), F.linear(x, layer.weight))
    assert _packed(twin)


def test_gradients_flow_through_f_linear_when_grad_is_on():
    layer = _routed(512, 512)
    layer.requires_grad_(True)
    x = torch.randn(32, 512, requires_grad=True)
    layer(x).square().sum().backward()
    expected_x = (2 * F.linear(x, layer.weight)) @ layer.weight
    torch.testing.assert_close(x.grad, expected_x.detach())
    assert layer.weight.grad is not None
    assert not _packed(layer)


def test_a_changed_weight_is_packed_again():
    layer = _routed(1536, 512)
    x = torch.randn(FIRST_ROW, 512)
    with torch.no_grad():
        layer(x)
        for change in ("in place", "load_into_model", "new parameter"):
            new = torch.randn_like(layer.weight) / 512**0.5  # nn.Linear's scale, not randn's
            if change == "in place":
                layer.weight.copy_(new)
            elif change == "load_into_model":
                load_into_model(nn.Sequential(layer), {"0.weight": new})
            else:
                layer.weight = nn.Parameter(new, requires_grad=False)
            _assert_rounding_close(layer(x), F.linear(x, new))


def test_an_inference_tensor_weight_is_not_packed():
    """Writes to an inference tensor leave no trace in a version counter, so a packed copy could
    not tell that it went stale."""
    layer = _routed(1536, 512)
    with torch.inference_mode():
        layer.weight = nn.Parameter(torch.randn(1536, 512), requires_grad=False)
        x = torch.randn(FIRST_ROW, 512)
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert not _packed(layer)


# ------------------------------------------------------------------------------------------------
# Through the sampler

SMALL = ModelConfig(name="builtin:small")
PROMPTS = ["12+34=", "The cat sat on"]
SAMPLES = 8  # 2 prompts x 8 samples: 16 rows, the first packed row count


def test_sampler_greedy_decode_on_packed_weights_matches_generate_after_a_weight_load():
    """The engine decodes once on its initial weights (packing them), then loads other weights:
    its greedy continuations must be the new weights' (``generate`` on the new model), which a
    packed copy left from the old weights would not give."""
    engine = SamplingEngine(SamplingEngineConfig(model=SMALL))
    assert sum(isinstance(m.forward, PackedLinear) for m in engine.model.modules()) > 0
    params = {"temperature": 0, "max_tokens": 12, "n": SAMPLES}
    engine.generate(PROMPTS, params)
    reference = perturbed(load_causal_lm(SMALL))
    engine.load_weights(export_weights(reference))
    routed = [m.forward for m in engine.model.modules() if isinstance(m.forward, PackedLinear)]
    # the load packed again what it changed (the next generate does not pay for it)
    assert all(r._stamp == (r.module.weight.data_ptr(), r.module.weight._version) for r in routed)

    outs = engine.generate(PROMPTS, params)

    assert all(_packed(m) for m in engine.model.modules() if isinstance(m.forward, PackedLinear))
    for i, prompt in enumerate(PROMPTS):
        ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        generated = reference.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=12, pad_token_id=0
        )[0, len(ids) :].tolist()
        ends = [at + 1 for at, token in enumerate(generated) if token in engine.eos_token_ids]
        expected = generated[: ends[0]] if ends else generated
        assert [out["token_ids"] for out in outs[i * SAMPLES : (i + 1) * SAMPLES]] == [
            expected
        ] * SAMPLES


def test_sleep_at_level_2_drops_the_packed_copies_and_sampling_after_wake_is_unchanged():
    engine = SamplingEngine(SamplingEngineConfig(model=SMALL))
    engine.load_weights(export_weights(perturbed(load_causal_lm(SMALL))))
    params = {"temperature": 0.9, "seed": 7, "max_tokens": 12, "n": SAMPLES}
    before = engine.generate(PROMPTS, params)
    routed = [m for m in engine.model.modules() if isinstance(m.forward, PackedLinear)]
    copied = sum(m.weight.numel() * m.weight.element_size() for m in routed)

    slept = engine.sleep(2)

    assert slept["packed_weight_bytes_released"] == copied > 0
    assert not any(_packed(m) for m in routed)
    assert engine.sleep(2)["packed_weight_bytes_released"] == 0  # nothing left to drop
    engine.wake()
    after = engine.generate(PROMPTS, params)
    assert [o["token_ids"] for o in after] == [o["token_ids"] for o in before]
    assert all(_packed(m) for m in routed)


def test_prompt_logprobs_score_with_the_trainers_products():
    """``prompt_logprobs`` promises the training engine's scores; a 40-token prompt is within the
    packed rows, so only the bypass keeps its products ``F.linear``'s."""
    reference = perturbed(load_causal_lm(SMALL))
    engine = SamplingEngine(SamplingEngineConfig(model=SMALL))
    engine.load_weights(export_weights(reference))
    ids = torch.randint(5, 100, (40,), generator=torch.Generator().manual_seed(3)).tolist()

    scored = engine.prompt_logprobs(ids)

    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].double()
    expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
    assert scored[0] is None
    torch.testing.assert_close(
        torch.tensor(scored[1:], dtype=torch.float64), expected[:, 0], rtol=0, atol=2e-6
    )
