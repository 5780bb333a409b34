"""The states a job and a Cortex request pass through, as every API and the client name them."""

from __future__ import annotations

from typing import Literal, get_args

JobState = Literal["pending", "initializing", "running", "failed", "cancelled", "terminated"]
JOB_STATES: tuple[JobState, ...] = get_args(JobState)
# A live job can still run ops (or will once built); a terminal one never again.
LIVE_JOB_STATES: tuple[JobState, ...] = ("pending", "initializing", "running")
TERMINAL_JOB_STATES: tuple[JobState, ...] = ("failed", "cancelled", "terminated")

RequestState = Literal["pending", "running", "done", "failed", "cancelled"]
REQUEST_STATES: tuple[RequestState, ...] = get_args(RequestState)
