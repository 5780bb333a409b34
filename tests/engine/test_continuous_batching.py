"""Continuous batching: calls that arrive while others decode join them, and nothing they share
(the batch, the KV cache, a weight load, a cancellation) changes what each one samples.

Every test acts at a precise point of a running decode through the core's ``after_step`` hook
(called on the core thread between two steps), so nothing depends on timing. The reference for
each output is the same request run alone on the same engine with the same seed.
"""

import threading

import pytest
import torch

from arctic_platform.engine import cancellation
from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.sampler import SamplingEngine
from arctic_platform.engine.weights import export_weights

MODEL = ModelConfig(name="builtin:tiny")
LONG = ("hello world, a longer prompt", {"max_tokens": 40, "ignore_eos": True, "seed": 11})
SHORT = ("The cat", {"n": 3, "max_tokens": 6, "ignore_eos": True, "seed": 5, "logprobs": 2})
JOIN_AT = 3  # decode steps the long request has taken when the short one is submitted


def _perturbed(seed: int, scale: float) -> dict:
    """The tiny model's weights, perturbed so that its predictions vary (its random
    initialisation is nearly uniform); ``seed`` and ``scale`` give different weight versions."""
    model = load_causal_lm(MODEL)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.add_(torch.randn(param.shape, generator=gen) * scale)
    return export_weights(model)


@pytest.fixture(scope="module")
def engine():
    engine = SamplingEngine(SamplingEngineConfig(model=MODEL))
    engine.load_weights(_perturbed(0, 0.15))
    yield engine
    engine.close()


def _solo(engine, request):
    prompt, params = request
    return engine.generate([prompt], params)


def _when(engine, condition, action):
    """Run ``action()`` once on the core thread, after the first step where ``condition()``."""
    fired = threading.Event()

    def listener():
        if not fired.is_set() and condition():
            fired.set()
            action()

    engine.core.after_step.append(listener)
    return fired


def _tokens(outputs):
    return [o["token_ids"] for o in outputs]


def _assert_same(outputs, expected):
    assert _tokens(outputs) == _tokens(expected)
    for got, want in zip(outputs, expected, strict=True):
        if "logprobs" in want:
            got_lp = [t["logprob"] for t in got["logprobs"]]
            want_lp = [t["logprob"] for t in want["logprobs"]]
            assert got_lp == pytest.approx(want_lp, abs=1e-4)


def test_a_request_joins_a_running_decode_and_both_equal_their_solo_runs(engine):
    expected_long, expected_short = _solo(engine, LONG), _solo(engine, SHORT)
    baseline = engine.core.stats()
    assert baseline["running_sequences"] == 0 and baseline["kv_cache_bytes_in_use"] == 0
    joined, in_use = {}, []
    first = engine.submit([LONG[0]], LONG[1])
    _when(
        engine,
        lambda: first.steps_run == JOIN_AT,
        lambda: joined.setdefault("short", engine.submit([SHORT[0]], SHORT[1])),
    )
    _when(
        engine,
        lambda: "short" in joined and joined["short"].steps_run == 1,
        lambda: in_use.append(engine.core.stats()),
    )
    long_out = first.result(timeout=120)
    second = joined["short"]
    short_out = second.result(timeout=120)
    _assert_same(long_out, expected_long)
    _assert_same(short_out, expected_short)
    # The short request started while the long one decoded, and ended before it.
    assert first.first_step < second.first_step < first.last_step
    assert second.last_step < first.last_step
    # Both decoded together: 1 + 3 rows, their KV in use; all of it free again once they ended.
    assert in_use[0]["running_sequences"] == 4 and in_use[0]["kv_cache_bytes_in_use"] > 0
    after = engine.core.stats()
    assert after["running_sequences"] == 0 and after["kv_cache_bytes_in_use"] == 0


def test_finished_sequences_give_their_kv_memory_to_later_calls(engine):
    _solo(engine, LONG)
    allocated = engine.core.stats()["kv_cache_bytes"]
    for _ in range(2):
        _solo(engine, LONG)
        _solo(engine, SHORT)
        stats = engine.core.stats()
        assert stats["kv_cache_bytes"] == allocated  # reused, not grown
        assert stats["running_sequences"] == 0 and stats["kv_cache_bytes_in_use"] == 0


def test_a_cancelled_call_leaves_at_the_next_step_and_the_others_go_on(engine):
    expected_short = _solo(engine, SHORT)
    token = cancellation.CancelToken()
    with cancellation.scope(token):
        doomed = engine.submit([LONG[0]], LONG[1])
    joined = {}
    _when(
        engine,
        lambda: doomed.steps_run == 1,
        lambda: joined.setdefault("short", engine.submit([SHORT[0]], SHORT[1])),
    )
    _when(engine, lambda: doomed.steps_run == JOIN_AT, lambda: token.cancel("job cancelled"))
    with pytest.raises(cancellation.OpCancelled) as err:
        doomed.result(timeout=120)
    assert err.value.reason == "job cancelled"
    assert doomed.steps_run == JOIN_AT  # it left at the step after the cancel
    _assert_same(joined["short"].result(timeout=120), expected_short)
    stats = engine.core.stats()
    assert stats["running_sequences"] == 0 and stats["kv_cache_bytes_in_use"] == 0


def test_a_weight_load_waits_for_running_sequences_and_later_calls_wait_for_it():
    engine = SamplingEngine(SamplingEngineConfig(model=MODEL))
    try:
        old, new = _perturbed(0, 0.15), _perturbed(1, 0.5)
        engine.load_weights(new)
        expected_new = _solo(engine, LONG)
        engine.load_weights(old)
        expected_old = _solo(engine, LONG)
        assert _tokens(expected_new) != _tokens(expected_old)  # the check below can fail

        running = engine.submit([LONG[0]], LONG[1])
        loaded = threading.Event()
        seen = {}

        def load():
            engine.load_weights(new)
            seen["running_done_at_load"] = running.done()
            loaded.set()

        def submit_late():  # blocks until the load is done
            seen["late"] = engine.submit([LONG[0]], LONG[1])

        loader, late = threading.Thread(target=load), threading.Thread(target=submit_late)
        _when(engine, lambda: running.steps_run == JOIN_AT, loader.start)
        # Once the load waits at the gate, a new call must wait behind it.
        waiting = _when(engine, lambda: engine._exclusive_waiting == 1, late.start)
        _assert_same(running.result(timeout=120), expected_old)  # one weight version throughout
        assert loaded.wait(120), "the weight load never ran"
        assert waiting.is_set(), "the load never waited for the running call"
        loader.join()
        late.join()
        assert seen["running_done_at_load"]
        _assert_same(seen["late"].result(timeout=120), expected_new)
    finally:
        engine.close()
