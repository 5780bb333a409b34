"""A cancel that lands while a job's builder hands a new engine to its sub-job.

The builder and the cancel run on different threads; whichever order their steps take, the
engine must be closed exactly once (on Ray an engine left open keeps its actors and the job's
placement group until the server restarts). The tests stop the real builder, building the
builtin tiny model, at a chosen step of that hand-over, cancel the job there, and let it go on.
"""

from __future__ import annotations

import threading

import pytest

from arctic_platform.server import engines
from arctic_platform.server.job_registry import SubJob
from tests.server.conftest import sub_job

WAIT_S = 120


class Gate:
    """Stops the builder thread at one step until the test opens it."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()

    def stop_here(self) -> None:
        self.reached.set()
        assert self.opened.wait(WAIT_S), "the test never let the builder go on"


def stopping_at(attribute: str, when, gate: Gate) -> type[SubJob]:
    """A SubJob whose builder stops just before it sets ``attribute`` to a value ``when`` accepts
    (the sub-job's own fields stay in its ``__dict__``, as in a plain SubJob)."""

    def get(sub: SubJob):
        return sub.__dict__[attribute]

    def put(sub: SubJob, value) -> None:
        if when(value) and threading.current_thread().name.startswith("job-init-"):
            gate.stop_here()
        sub.__dict__[attribute] = value

    return type("StoppingSubJob", (SubJob,), {attribute: property(get, put)})


@pytest.mark.parametrize(
    ("attribute", "when"),
    [
        # Before the engine is stored: the cancel finds no engine to release.
        ("engine", lambda value: value is not None),
        # After the engine is stored, before the builder looks at the cancel flag again.
        ("status", lambda value: value == "running"),
    ],
    ids=["before-the-engine-is-stored", "after-the-engine-is-stored"],
)
def test_an_engine_whose_job_is_cancelled_while_it_is_handed_over_is_closed_once(
    service, monkeypatch, attribute, when
):
    gate = Gate()
    built: list[tuple[str, list[str]]] = []
    builders: list[threading.Thread] = []
    real_build = engines.build_engine

    def build(svc, sub, source):
        engine = real_build(svc, sub, source)  # the real tiny model, loaded
        closes: list[str] = []
        engine.close = lambda: closes.append(sub.sub_job_id)  # local engines hold nothing else
        built.append((sub.sub_job_id, closes))
        builders.append(threading.current_thread())
        sub.__class__ = stopping_at(attribute, when, gate)
        return engine

    monkeypatch.setattr(engines, "build_engine", build)
    job_id = service.create_job(
        {"sub_job_configs": [sub_job("log_probability"), sub_job("sampling")]}
    )["job_id"]
    assert gate.reached.wait(WAIT_S), service.get_job(job_id)

    assert service.cancel_job(job_id)["status"] == "cancelled"
    gate.opened.set()
    builders[0].join(WAIT_S)
    assert not builders[0].is_alive()

    # One engine was built (the build stops before the next), closed exactly once, and no
    # sub-job keeps an engine.
    assert built == [(f"{job_id}:log_prob:0", [f"{job_id}:log_prob:0"])]
    job = service.get_job(job_id)
    assert job["status"] == "cancelled"
    assert [s["status"] for s in job["sub_jobs"]] == ["cancelled", "cancelled"]
    assert service.resolve(job_id, owner=None, kind="log_prob").engine is None
    assert not any("engine ready" in line for line in service.tail_logs(job_id)["entries"])
