"""The states a job and a Cortex request pass through, as every API and the client name them."""

from __future__ import annotations

from typing import Any, Literal, get_args

JobState = Literal["pending", "initializing", "running", "failed", "cancelled", "terminated"]
JOB_STATES: tuple[JobState, ...] = get_args(JobState)
# A starting job will run once its engines are built (what waiting for a job waits through); a
# live job can still run ops (or will once built); a terminal one never again.
STARTING_JOB_STATES: tuple[JobState, ...] = ("pending", "initializing")
LIVE_JOB_STATES: tuple[JobState, ...] = (*STARTING_JOB_STATES, "running")
TERMINAL_JOB_STATES: tuple[JobState, ...] = ("failed", "cancelled", "terminated")

RequestState = Literal["pending", "running", "done", "failed", "cancelled"]
REQUEST_STATES: tuple[RequestState, ...] = get_args(RequestState)


def cortex_name(value: Any, prefix: str) -> str:
    """A Cortex enum value as we spell it: lower case, without its prefix (``JOB_STATE_RUNNING``
    with ``job_state_`` is ``running``, ``JOB_TYPE_TRAINING`` with ``job_type_`` ``training``)."""
    text = str(value or "").lower()
    return text[len(prefix) :] if text.startswith(prefix) else text
