"""Concurrent sample requests on one sampler decode together and get what each would alone."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.sampler import SamplingEngine
from arctic_platform.server.errors import BadRequest, Conflict
from arctic_platform.server.tinker.sample_batcher import SampleBatcher
from arctic_platform.server.tinker.snapshot_loads import SnapshotWeights


@pytest.fixture(scope="module")
def engine():
    return SamplingEngine(
        SamplingEngineConfig(model=ModelConfig(name="builtin:tiny", device="cpu"))
    )


def counting_sub(engine, sub_job_id: str) -> tuple[SimpleNamespace, list[int]]:
    """A sampling sub-job over ``engine`` that records how many prompts each generate got."""
    calls: list[int] = []

    def counting_generate(prompts, params):
        calls.append(len(prompts))
        return engine.generate(prompts, params)

    fields = {"generate": counting_generate, "prompt_logprobs": engine.prompt_logprobs}
    sub_engine = SimpleNamespace(**fields, vocab_size=engine.vocab_size)
    return SimpleNamespace(sub_job_id=sub_job_id, engine=sub_engine), calls


def holding_submit(held: list):
    """A sub-job queue that only records each drain's runner; the test runs it when it wants."""

    def submit(runner, alone=False) -> Future:
        held.append(runner)
        return Future()

    return submit


def test_requests_queued_together_run_in_one_generate_call(engine):
    original = engine.generate
    sub, calls = counting_sub(engine, "j:sampling:0")
    held: list = []

    def submit(runner, alone=False) -> Future:  # the sub-job queue, held until every request is in
        future: Future = Future()
        held.append((runner, future))
        return future

    batcher = SampleBatcher()
    requests = [
        ([20, 21, 22], {"n": 2, "max_tokens": 5, "seed": 1, "logprobs": 0}, False),
        ([30, 31], {"n": 1, "max_tokens": 4, "seed": 2, "logprobs": 0}, True),
        ([40], {"n": 3, "max_tokens": 3, "seed": 3, "logprobs": 0}, False),
    ]
    futures = [batcher.add(sub, p, params, pl, submit) for p, params, pl in requests]
    assert len(held) == 1  # one drain queued for all three
    runner, drained = held[0]
    runner()
    drained.set_result(None)
    assert calls == [3]
    for (prompt, params, want_pl), future in zip(requests, futures, strict=True):
        outputs, scored = future.result()
        alone = original([prompt], params)
        assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in alone]
        assert (scored is not None) == want_pl
    with pytest.raises(BadRequest) as bad:
        batcher.add(sub, [1], {"n": 0}, False, submit)
    assert str(bad.value).startswith("sampling_params.n: must be >= 1")  # named once
    assert bad.value.details == {"field": "sampling_params.n"}
    with pytest.raises(BadRequest, match="prompt: token ids"):
        batcher.add(sub, [10**6], {"n": 1}, False, submit)


def test_a_failed_drain_fails_the_requests_it_held(engine):
    sub = SimpleNamespace(sub_job_id="j:sampling:1", engine=engine)
    held: list = []

    def submit(runner, alone=False) -> Future:
        future: Future = Future()
        held.append(future)
        return future

    batcher = SampleBatcher()
    first = batcher.add(sub, [5, 6], {"n": 1, "max_tokens": 2}, False, submit)
    second = batcher.add(sub, [7], {"n": 1, "max_tokens": 2}, False, submit)
    held[0].set_exception(BadRequest("stopped"))
    for future in (first, second):
        with pytest.raises(BadRequest, match="stopped"):
            future.result()


def test_requests_arriving_while_a_drain_starts_join_it(engine):
    """The SDK's requests of one group arrive milliseconds apart; the first one's drain, started
    on an idle sampler, waits for the others instead of decoding alone (two decode loops)."""
    import threading
    import time

    sub, calls = counting_sub(engine, "j:sampling:2")

    def submit(runner, alone=False) -> Future:  # an idle sub-job queue: the drain starts at once
        future: Future = Future()
        started = threading.Event()

        def run():
            started.set()
            runner()
            future.set_result(None)

        threading.Thread(target=run, daemon=True).start()
        started.wait()
        time.sleep(0.05)  # the drain is under way before the next request arrives
        return future

    batcher = SampleBatcher(linger_gap_s=0.5, linger_max_s=5.0)
    params = {"n": 1, "max_tokens": 2, "seed": 0}
    futures = [batcher.add(sub, [10 + i], params, False, submit) for i in range(3)]
    for future in futures:
        future.result(timeout=60)
    assert calls == [3]


def test_a_burst_the_size_of_the_last_ones_starts_without_the_long_wait(engine):
    """Once a sampler's drains have seen bursts of ``k`` requests, a drain holding ``k`` waits
    only the settle gap: with a gap of an hour, the second burst is still decoded."""
    import threading

    sub, calls = counting_sub(engine, "j:sampling:3")
    held: list = []
    submit = holding_submit(held)

    batcher = SampleBatcher(linger_gap_s=0.0, linger_max_s=3600.0, linger_settle_s=0.0)
    params = {"n": 1, "max_tokens": 2, "seed": 0}
    first = [batcher.add(sub, [10 + i], params, False, submit) for i in range(3)]
    held.pop()()  # no history yet: the drain waits the full gap (zero here)
    assert all(f.done() for f in first)
    batcher.linger_gap_s = 3600.0
    second = [batcher.add(sub, [20 + i], params, False, submit, key="snapshot") for i in range(3)]
    drain = threading.Thread(target=held.pop(), daemon=True)
    drain.start()  # three pending, as many as the last burst: no hour-long wait
    for future in second:
        future.result(timeout=60)
    assert calls == [3, 3]


def test_a_drained_queue_is_dropped_and_its_key_batches_again(engine):
    """Each sampler snapshot batches under its own key; an idle queue is not kept per key (a
    long run would keep one per step), and a later request for the key is served as before."""
    sub, calls = counting_sub(engine, "j:sampling:4")
    held: list = []
    submit = holding_submit(held)

    batcher = SampleBatcher(linger_gap_s=0.0)
    params = {"n": 1, "max_tokens": 2, "seed": 0}
    for step in range(3):
        futures = [
            batcher.add(sub, [10 + i], params, False, submit, key=f"s{step}") for i in (0, 1)
        ]
        held.pop()()
        assert all(f.result(timeout=60) for f in futures)
        assert batcher._queues == {}
    again = batcher.add(sub, [12], params, False, submit, key="s0")
    held.pop()()
    assert again.result(timeout=60)[0][0]["token_ids"]
    assert calls == [2, 2, 2, 1]


class FakeSnapshot:
    """A snapshot's weights (``WeightSnapshot``) that records the engines it was loaded into."""

    def __init__(self, *, fails: bool = False) -> None:
        self.fails = fails
        self.loaded_into: list = []

    def load_into(self, engine) -> None:
        if self.fails:
            raise RuntimeError("the load failed part-way")
        self.loaded_into.append(engine)


def test_on_a_running_batch_each_drain_starts_at_once_and_only_weight_loads_run_alone(engine):
    """``joins``: the sampler's running batch takes late requests mid-decode, so a drain does not
    linger (with an hour's gap it would never end) and runs beside others; only a drain that must
    load a snapshot's weights first runs alone: a later drain of the snapshot loaded (or queued
    to load) needs no load and joins too."""
    import threading

    sub, calls = counting_sub(engine, "j:sampling:4")
    alone_flags: list[bool] = []

    def submit(runner, alone=False) -> Future:  # an idle sub-job queue: the drain starts at once
        alone_flags.append(alone)
        future: Future = Future()

        def run():
            runner()
            future.set_result(None)

        threading.Thread(target=run, daemon=True).start()
        return future

    batcher = SampleBatcher(linger_gap_s=3600, linger_max_s=3600)
    params = {"n": 1, "max_tokens": 2, "seed": 0}
    first = batcher.add(sub, [10], params, False, submit, joins=True)
    assert first.result(timeout=60)[0][0]["token_ids"]
    batcher = SampleBatcher()
    weights = SnapshotWeights()
    one, two = FakeSnapshot(), FakeSnapshot()
    for number, snapshot in ((1, one), (1, one), (2, two), (1, one)):
        load = weights.load_of(sub.sub_job_id, ("run", number), snapshot)
        sampled = batcher.add(
            sub, [11], params, False, submit, joins=True, key=f"s{number}", load=load
        )
        assert sampled.result(timeout=60)[0][0]["token_ids"]
    assert alone_flags == [False, True, False, True, True]
    assert one.loaded_into == [sub.engine, sub.engine] and two.loaded_into == [sub.engine]
    assert calls == [1, 1, 1, 1, 1]


def test_a_drain_that_planned_on_a_load_that_failed_is_refused_and_the_next_loads_again():
    weights = SnapshotWeights()
    broken, engine = FakeSnapshot(fails=True), object()
    loading, after = (weights.load_of("j:sampling:0", ("run", 1), broken) for _ in "ab")
    assert loading.plan() and not after.plan()  # the second finds the first's load queued
    with pytest.raises(RuntimeError, match="failed part-way"):
        loading.load(engine)
    with pytest.raises(Conflict, match="snapshot 1 of run could not be loaded") as refused:
        after.check()
    assert refused.value.status == 409
    good = FakeSnapshot()
    again = weights.load_of("j:sampling:0", ("run", 1), good)
    assert again.plan()  # the failed load left no plan: this drain loads
    again.load(engine)
    again.check()
    assert good.loaded_into == [engine]
