"""The sampler's running batch: calls that arrive mid-decode join it, finished calls leave it.

Every test pins *when* the second call arrives with a hook on the model's forward (it runs on the
thread driving the batch): at a chosen forward it waits, boundedly, until the engine reports the
second call (or a weight load) queued, so "it joined mid-decode" is a fact the test arranges and
checks (``batch_state()["joins"]``), not a race. Outputs are compared with each request run alone
with the same seed: token ids exactly, log-probs to float tolerance (the joined batch pads
differently).
"""

import threading
from concurrent.futures import Future

import pytest
import torch

from arctic_platform.engine import cancellation
from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.running_batch import Slice
from arctic_platform.engine.sampler import SamplingEngine
from arctic_platform.engine.weights import export_weights
from tests.perturbed import perturbed
from tests.waiting import wait_until

MODEL = ModelConfig(name="builtin:tiny")
LONG_PROMPT = "The cat"
LONG = {"seed": 11, "temperature": 1.0, "max_tokens": 40, "ignore_eos": True, "logprobs": 2}
SHORT = {"seed": 5, "temperature": 0.8, "max_tokens": 6, "n": 2, "logprobs": 1, "ignore_eos": True}
WAIT_S = 60


def _perturbed(seed: int) -> dict:
    return export_weights(perturbed(load_causal_lm(MODEL), seed))


@pytest.fixture(scope="module")
def weights():
    return _perturbed(0)


@pytest.fixture(scope="module")
def engine(weights):
    engine = SamplingEngine(SamplingEngineConfig(model=MODEL))
    engine.load_weights(weights)
    return engine


def _in_thread(fn, *args, token=None) -> Future:
    """Run ``fn(*args)`` on a new thread (inside ``token``'s cancellation scope when given)."""
    future: Future = Future()

    def run():
        try:
            with cancellation.scope(*(() if token is None else (token,))):
                future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


class Forwards:
    """Counts the model's forwards; ``on(n, fn)`` runs ``fn`` on the driving thread at the n-th."""

    def __init__(self, engine):
        self.count = 0
        self.actions: dict[int, list] = {}
        self.reached: dict[int, threading.Event] = {}
        self._hook = engine.model.register_forward_pre_hook(self._forward)

    def on(self, n: int, fn=None) -> threading.Event:
        if fn is not None:
            self.actions.setdefault(n, []).append(fn)
        return self.reached.setdefault(n, threading.Event())

    def _forward(self, _module, _args):
        self.count += 1
        if self.count in self.reached:
            self.reached[self.count].set()
        for fn in self.actions.get(self.count, ()):
            fn()

    def remove(self):
        self._hook.remove()


def _tokens(outputs):
    return [o["token_ids"] for o in outputs]


def _assert_same(joined, alone):
    assert _tokens(joined) == _tokens(alone)
    for a, b in zip(joined, alone, strict=True):
        assert [e["rank"] for e in a["logprobs"]] == [e["rank"] for e in b["logprobs"]]
        got = torch.tensor([e["logprob"] for e in a["logprobs"]])
        want = torch.tensor([e["logprob"] for e in b["logprobs"]])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


_hooks: list[Forwards] = []


@pytest.fixture(autouse=True)
def _remove_hooks():
    yield
    while _hooks:
        _hooks.pop().remove()


def _hooked(engine) -> Forwards:
    forwards = Forwards(engine)
    _hooks.append(forwards)  # removed after the test, once every call of it is over
    return forwards


def _long_then_joining(engine, joining_prompt, *, then=None, token_long=None, token_short=None):
    """Start the long call; at its 3rd forward (its prefill and 2 decode steps, or 3 decode steps
    when its prompt came from the prompt cache) wait until the short call is queued, so it joins
    at the next step; ``then`` maps later forwards to actions."""
    forwards = _hooked(engine)
    waiting = engine.batch_state()["waiting_calls"]
    forwards.on(
        3,
        lambda: wait_until(
            lambda: engine.batch_state()["waiting_calls"] > waiting, what="the joining call queued"
        ),
    )
    for n, fn in (then or {}).items():
        forwards.on(n, fn)
    long = _in_thread(engine.generate, [LONG_PROMPT], LONG, token=token_long)
    assert forwards.on(3).wait(WAIT_S), "the long call never reached its 3rd forward"
    short = _in_thread(engine.generate, [joining_prompt], SHORT, token=token_short)
    return long, short


@pytest.mark.parametrize("cached", [False, True], ids=["prefilled", "from-the-prompt-cache"])
@pytest.mark.parametrize(
    "joining_prompt",
    ["What is the meaning of life?", "a"],
    ids=["longer-prompt-joins", "shorter-prompt-joins"],
)
def test_a_call_arriving_mid_decode_joins_and_matches_running_alone(engine, joining_prompt, cached):
    """Both prompts prefilled, or both copied from the prompt cache (the runs alone cached
    them): the joining one then lands in the running batch's prefix store by a copy."""
    long_alone = engine.generate([LONG_PROMPT], LONG)
    short_alone = engine.generate([joining_prompt], SHORT)
    if not cached:
        engine.reset_prefix_cache()
    joins = engine.batch_state()["joins"]
    hits = engine.batch_state()["prompt_cache"]["hits"]
    long, short = _long_then_joining(engine, joining_prompt)
    _assert_same(long.result(WAIT_S), long_alone)
    _assert_same(short.result(WAIT_S), short_alone)
    assert engine.batch_state()["joins"] == joins + 1  # it joined the running batch once
    assert engine.batch_state()["prompt_cache"]["hits"] == hits + (2 if cached else 0)


def test_a_call_whose_prompt_extends_a_cached_one_joins_mid_decode(engine, weights):
    """The joining prompt's start is in the prompt cache (a multi-turn rollout's last turn): it is
    copied into the running batch's prefix store and only the rest is prefilled, attending to it."""
    joining = "What is the meaning of life?"
    long_alone = engine.generate([LONG_PROMPT], LONG)
    short_alone = engine.generate([joining], SHORT)
    engine.reset_prefix_cache()
    ids = engine.tokenizer(joining, add_special_tokens=False)["input_ids"]
    engine.generate([ids[:-3]], {"max_tokens": 1})
    joins = engine.batch_state()["joins"]
    prefix_hits = engine.batch_state()["prompt_cache"]["prefix_hits"]
    long, short = _long_then_joining(engine, joining)
    _assert_same(long.result(WAIT_S), long_alone)
    _assert_same(short.result(WAIT_S), short_alone)
    assert engine.batch_state()["joins"] == joins + 1
    assert engine.batch_state()["prompt_cache"]["prefix_hits"] == prefix_hits + 1
    # It continued a cached prompt, so its finished sequences were cached, from the suffix
    # columns they were written to beside the long call's: sent back whole, one is a hit.
    back = [*ids, *short_alone[1]["token_ids"][:-1]]
    hits = engine.batch_state()["prompt_cache"]["hits"]
    uncached = SamplingEngine(SamplingEngineConfig(model=MODEL, prompt_cache_bytes=0))
    uncached.load_weights(weights)
    _assert_same(engine.generate([back], SHORT), uncached.generate([back], SHORT))
    assert engine.batch_state()["prompt_cache"]["hits"] == hits + 1


def test_a_finished_call_leaves_and_returns_before_the_long_one(engine):
    """The short call (6 tokens) joins at the long call's 3rd forward; by the 12th its rows are
    done. The hook holds the long call (it drives) there until the short call has returned:
    without per-call results it would wait in vain."""
    seen = {}

    def short_is_back():
        wait_until(lambda: short.done(), what="the short call to return while the long one decodes")
        seen.update(engine.batch_state(), long_done=long.done())

    long, short = _long_then_joining(engine, "a", then={12: short_is_back})
    assert len(short.result(WAIT_S)) == 2
    assert len(long.result(WAIT_S)[0]["token_ids"]) == LONG["max_tokens"]
    assert seen["long_done"] is False
    assert (seen["running_rows"], seen["running_calls"]) == (1, 1)  # only the long row is left


@pytest.mark.parametrize("cancelled", ["long", "short"])
def test_cancelling_one_call_leaves_the_other_intact(engine, cancelled):
    """The long call drives the batch; cancelling it hands the loop to the short call's thread.
    Cancelling the short one ends only its rows."""
    long_alone = engine.generate([LONG_PROMPT], LONG)
    short_alone = engine.generate(["a"], SHORT)
    tokens = {"long": cancellation.CancelToken(), "short": cancellation.CancelToken()}
    stop = tokens[cancelled]
    long, short = _long_then_joining(
        engine,
        "a",
        token_long=tokens["long"],
        token_short=tokens["short"],
        then={5: lambda: stop.cancel("test stop")},
    )
    stopped, kept, kept_alone = (long, short, short_alone)
    if cancelled == "short":
        stopped, kept, kept_alone = short, long, long_alone
    with pytest.raises(cancellation.OpCancelled, match="test stop"):
        stopped.result(WAIT_S)
    _assert_same(kept.result(WAIT_S), kept_alone)
    assert engine.batch_state()["running_rows"] == 0


def test_a_weight_load_waits_for_the_running_call_and_the_next_call_sees_it(engine, weights):
    """While the long call decodes, a load_weights and then another generate arrive: the long
    call finishes on the old weights, the load runs after it, the later call sees the new ones."""
    new_weights = _perturbed(1)
    prompt = "hello world"
    params = {"seed": 3, "max_tokens": 12, "temperature": 1.0, "logprobs": 0}
    long_old = engine.generate([LONG_PROMPT], LONG)
    later_old = engine.generate([prompt], params)
    forwards = _hooked(engine)
    released = threading.Event()
    forwards.on(3, lambda: released.wait(WAIT_S))
    try:
        long = _in_thread(engine.generate, [LONG_PROMPT], LONG)
        assert forwards.on(3).wait(WAIT_S)
        load = _in_thread(engine.load_weights, new_weights)
        wait_until(lambda: engine.batch_state()["waiting_exclusive"] == 1, what="the load queued")
        later = _in_thread(engine.generate, [prompt], params)
        wait_until(lambda: engine.batch_state()["waiting_calls"] == 1, what="the later call queued")
        assert not load.done()  # the load waits for the running call
        released.set()
        _assert_same(long.result(WAIT_S), long_old)
        assert load.result(WAIT_S)["complete"]
        later_new = later.result(WAIT_S)
        forwards.actions.clear()
        alone_new = engine.generate([prompt], params)
        assert _tokens(later_new) == _tokens(alone_new)
        assert _tokens(later_new) != _tokens(later_old)  # the new weights change the sample
    finally:
        released.set()
        engine.load_weights(weights)


def test_a_failure_while_a_call_joins_fails_both_calls_and_leaves_the_engine_working(engine):
    """The joining call's prefill (the 4th forward) fails, as a device error would, after the
    batch took in its rows: both calls get that error (neither a wrong answer nor an error of the
    clean-up), and the next call runs as it would alone. Which call the clean-up ends first
    varies between runs (a set), so the scenario runs several times."""
    long_alone = engine.generate([LONG_PROMPT], LONG)

    def fail():
        raise RuntimeError("simulated device failure")

    for _ in range(4):
        long, short = _long_then_joining(engine, "What is the meaning of life?", then={4: fail})
        for call in (long, short):
            with pytest.raises(RuntimeError, match="simulated device failure"):
                call.result(WAIT_S)
        assert engine.batch_state()["running_rows"] == 0
        _hooks.pop().remove()
    _assert_same(engine.generate([LONG_PROMPT], LONG), long_alone)


def _drive(engine, joining_at: dict[int, list]) -> dict:
    """Step the engine's running batch by hand, admitting ``joining_at[step]`` before that
    step's sample; return each owner's finished token ids."""
    batch, done, step = engine._loop.batch, {}, 0
    with torch.inference_mode():
        while not batch.empty or any(at >= step for at in joining_at):
            if joining_at.get(step):
                batch.admit(batch.plan(joining_at[step]))
            if not batch.empty:
                done.update({f.owner: f.token_ids for f in batch.sample()})
                batch.advance()
            step += 1
    return done


def test_a_row_joins_after_the_row_that_needed_the_widest_outputs_left(engine):
    """A (24 tokens) decodes, B (10) joins at step 20, A finishes and leaves at step 24, C (5)
    joins at step 26: the output buffers shrink to B's and C's widths while B's tokens so far
    are carried over (this join used to fail the whole batch)."""
    greedy = {"temperature": 0, "ignore_eos": True}
    prompts = {"A": ("The cat", 24), "B": ("hello world", 10), "C": ("1+1=", 5)}
    alone = {
        name: engine.generate([prompt], {**greedy, "max_tokens": m})[0]["token_ids"]
        for name, (prompt, m) in prompts.items()
    }

    def slice_of(name):
        prompt, m = prompts[name]
        request = engine._validate([prompt], {**greedy, "max_tokens": m})[0]
        return Slice(name, request, 0, 1)

    joined = _drive(engine, {0: [slice_of("A")], 20: [slice_of("B")], 26: [slice_of("C")]})
    assert joined == alone
