"""The request registry the Cortex and Tinker APIs share: scoping, retention, error mapping and
long-poll waits."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future

import pytest

from arctic_platform.server.errors import BadRequest, NotFound, ServiceError
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
