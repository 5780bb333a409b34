"""The shutdown drain: stop taking work, let what is in flight finish, then end every job.

A server going down should neither cut an op short that is about to finish nor wait forever on
one that never will. So new jobs and ops are refused at once, builds are stopped, and ops queued
or running get until the deadline; a job still busy then is failed with that reason (its ops stop
at their next decode step or microbatch), the others end ``terminated``, and every engine is
released either way.
"""

from __future__ import annotations

import time
from concurrent.futures import wait as wait_futures

from arctic_platform.contract.states import TERMINAL_JOB_STATES
from arctic_platform.server.job_builder import JobBuilder
from arctic_platform.server.job_registry import JobRegistry


def drain(jobs: JobRegistry, builder: JobBuilder, timeout: float) -> None:
    """End every job of ``jobs``, giving builds and ops in flight ``timeout`` seconds in all."""
    deadline = time.monotonic() + timeout
    with jobs.lock:
        every_job = jobs.close()
        builders = builder.threads()
    for job in every_job:
        if job.status in ("pending", "initializing"):
            job.cancelled.set()  # a build under way stops before its next engine
            job.stop.cancel("the server is shutting down")  # and waits for no resources
    for thread in builders:
        thread.join(max(0.0, deadline - time.monotonic()))
    for job in every_job:
        for sub in job.sub_jobs:
            if sub.queue is not None:
                sub.queue.shutdown(wait=False)  # queued ops still run, new ones are refused
    with jobs.lock:
        pending = [f for job in every_job for f in job.in_flight]
    wait_futures(pending, timeout=max(0.0, deadline - time.monotonic()))
    for job in every_job:
        with jobs.lock:
            busy = bool(job.in_flight)
        if busy:
            reason = f"server shut down with ops in flight after --drain-timeout {timeout:g}s"
            job.stop.cancel(reason)  # its ops stop at their next step or microbatch
            jobs.fail(job, reason)
        elif job.status not in TERMINAL_JOB_STATES:
            jobs.set_status(job, "terminated", "server shut down")
        jobs.release(job)
