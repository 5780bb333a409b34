"""The request registry the Cortex and Tinker APIs share: scoping, retention, error mapping and
long-poll waits."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Future

import pytest

from arctic_platform.server.errors import (
    BadRequest,
    NotFound,
    ServiceError,
    failure_of,
    result_of,
)
from arctic_platform.server.request_registry import (
    RequestRegistry,
    TrackedRequest,
    finished_within,
    outcome,
)


def finished(value=None) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def test_a_request_is_found_only_in_its_scope_and_a_stranger_sees_an_unknown_id():
    registry: RequestRegistry[TrackedRequest] = RequestRegistry(max_finished=10)
    request = registry.add(TrackedRequest(future=Future()), scope="alice")
    assert registry.get(request.request_id, scope="alice") is request
    with pytest.raises(NotFound) as stolen:
        registry.get(request.request_id, scope="bob")
    with pytest.raises(NotFound) as unknown:
        registry.get("f" * 32, scope="alice")
    assert str(stolen.value) == str(unknown.value).replace("f" * 32, request.request_id)
    with pytest.raises(NotFound):  # no scope (auth off) is a scope of its own
        registry.get(request.request_id, scope=None)


def test_request_ids_are_new_for_every_request():
    registry: RequestRegistry[TrackedRequest] = RequestRegistry(max_finished=10)
    ids = {registry.add(TrackedRequest(future=Future()), scope=None).request_id for _ in range(50)}
    assert len(ids) == 50


def test_past_the_limit_the_first_finished_is_dropped_and_running_ones_stay():
    registry: RequestRegistry[TrackedRequest] = RequestRegistry(max_finished=2)
    running = registry.add(TrackedRequest(future=Future()), scope="a").request_id
    first, second, third = (
        registry.add(TrackedRequest(future=finished(i)), scope="a").request_id for i in (1, 2, 3)
    )
    with pytest.raises(NotFound):
        registry.get(first, scope="a")
    registry.get(running, scope="a").future.set_result(0)  # finishes last: second goes
    assert registry.get(running, scope="a").future.result() == 0
    assert registry.get(third, scope="a").future.result() == 3
    with pytest.raises(NotFound):
        registry.get(second, scope="a")


def test_outcome_passes_service_errors_and_names_the_request_for_any_other(caplog):
    caplog.set_level(logging.ERROR, logger="arctic_platform.server")
    assert outcome("r1", lambda: 7) == 7
    refused = BadRequest("lr: must be finite")

    def refuse():
        raise refused

    def bug():
        raise RuntimeError("secret internals")

    with pytest.raises(BadRequest) as raised:
        outcome("r2", refuse)
    assert raised.value is refused
    with pytest.raises(ServiceError) as internal:
        outcome("r3", bug)
    assert internal.value.status == 500 and internal.value.code == "internal_error"
    assert internal.value.body()["request_id"] == "r3"
    assert "secret" not in str(internal.value)
    (logged,) = [r for r in caplog.records if "r3" in r.getMessage()]
    assert "secret internals" in str(logged.exc_info[1])


def test_finished_within_waits_up_to_the_timeout_and_leaves_the_op_running():
    async def scenario():
        pending: Future = Future()
        assert await finished_within(pending, 0.05) is False
        assert not pending.cancelled()
        asyncio.get_running_loop().call_later(0.05, pending.set_result, "late")
        assert await finished_within(pending, 5.0) is True
        failed: Future = Future()
        failed.set_exception(RuntimeError("op failed"))
        assert await finished_within(failed, 5.0) is True  # an error is an end too

    asyncio.run(scenario())


async def test_an_op_whose_job_ended_before_it_ran_is_a_job_cancelled_conflict():
    """A job's end cancels the ops still in its queue: every waiter sees the 409, a Tinker poll
    answers it as the caller's error, and nothing waits for ever or logs an internal error."""
    from arctic_platform.server.tinker.futures import FutureStore
    from arctic_platform.server.tinker.operations import _copy_outcome

    queued: Future = Future()
    assert queued.cancel()
    assert await finished_within(queued, timeout=5.0)  # not a CancelledError out of the poll
    with pytest.raises(ServiceError) as raised:
        result_of(queued)
    assert (raised.value.status, raised.value.code) == (409, "job_cancelled")
    assert failure_of(queued).code == "job_cancelled"

    outer: Future = Future()  # a Tinker op's future, fed by the job queue's
    _copy_outcome(queued, outer)
    assert outer.done() and outer.exception().code == "job_cancelled"
    store = FutureStore()
    answer = await store.retrieve(store.add("alice", queued), "alice")
    assert answer.status_code == 200
    assert json.loads(answer.body) == {
        "error": "the op did not run: its job ended first",
        "category": "user",
    }


def test_past_the_limit_the_scope_holding_the_most_drops_its_own_first_finished():
    # Bob runs many quick ops; Alice's one result, not yet polled, stays retrievable.
    registry: RequestRegistry[TrackedRequest] = RequestRegistry(max_finished=4)
    alices = registry.add(TrackedRequest(future=finished("alice")), scope="alice").request_id
    bobs = [
        registry.add(TrackedRequest(future=finished(i)), scope="bob").request_id for i in range(10)
    ]
    assert registry.get(alices, scope="alice").future.result() == "alice"
    for dropped in bobs[:7]:
        with pytest.raises(NotFound):
            registry.get(dropped, scope="bob")
    assert [registry.get(i, scope="bob").future.result() for i in bobs[7:]] == [7, 8, 9]
    # Alice's next finished ones drop Bob's oldest while he holds more, then her own.
    more = [
        registry.add(TrackedRequest(future=finished(i)), scope="alice").request_id for i in range(3)
    ]
    for dropped, scope in ((alices, "alice"), (more[0], "alice"), (bobs[7], "bob")):
        with pytest.raises(NotFound):
            registry.get(dropped, scope=scope)
    assert [registry.get(i, scope="alice").future.result() for i in more[1:]] == [1, 2]
    assert [registry.get(i, scope="bob").future.result() for i in bobs[8:]] == [8, 9]


def test_past_the_byte_bound_the_scope_holding_the_most_bytes_drops_its_oldest():
    sizes = {"small": 10, "large": 60}
    registry: RequestRegistry[TrackedRequest] = RequestRegistry(
        max_finished=100, max_finished_bytes=100, size=lambda r: sizes[r.future.result()]
    )
    alices = registry.add(TrackedRequest(future=finished("small")), scope="alice").request_id
    bobs = [
        registry.add(TrackedRequest(future=finished("large")), scope="bob").request_id
        for _ in range(3)
    ]
    # 10 + 60 + 60 > 100: Bob's first went, then again at his third.
    for dropped in bobs[:2]:
        with pytest.raises(NotFound):
            registry.get(dropped, scope="bob")
    assert registry.get(bobs[2], scope="bob").future.result() == "large"
    assert registry.get(alices, scope="alice").future.result() == "small"
    # A result larger than the bound alone stays (it just finished), and drops nobody's:
    # dropping others could not make room for it. It goes at the next finish.
    sizes["huge"] = 500
    huge = registry.add(TrackedRequest(future=finished("huge")), scope="carol").request_id
    assert registry.get(huge, scope="carol").future.result() == "huge"
    assert registry.get(bobs[2], scope="bob").future.result() == "large"
    assert registry.get(alices, scope="alice").future.result() == "small"
    registry.add(TrackedRequest(future=finished("small")), scope="alice")
    with pytest.raises(NotFound):
        registry.get(huge, scope="carol")
    assert registry.get(bobs[2], scope="bob").future.result() == "large"
