"""What an operator scrapes from ``GET /metrics`` (Prometheus text format, ``prometheus_client``).

* ``arctic_ops_total{op,status}`` and ``arctic_op_seconds{op}``: every op that ran, how it ended
  (``ok`` or the error code) and how long it took on its engine;
* ``arctic_tokens_processed_total{op}``: tokens of training/forward batches and generated tokens;
* ``arctic_queue_depth{job_id}``: ops submitted to a job and not finished (running or waiting);
* ``arctic_jobs{state}``: jobs by state.

Who sees which jobs: the scrape credential (``serve --metrics-token-env``) sees every job; a
tenant's token sees the server-wide op series and the two job gauges of its own jobs only, so no
tenant learns another's job ids (the same scoping as every other route).

Each Service has its own registry, so several Services in one process (tests, the in-process
backend) do not collide; the gauges are read from the Service when scraped.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)


class ServiceMetrics:
    """The counters the Service updates as ops run, and its registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ops = Counter(
            "arctic_ops",
            "Ops that ran, by op and outcome.",
            ["op", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "arctic_op_seconds",
            "Time an op ran on its engine.",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "arctic_tokens_processed",
            "Tokens of batches and generations.",
            ["op"],
            registry=self.registry,
        )

    @contextlib.contextmanager
    def op(self, name: str) -> Iterator[None]:
        """Count and time one op; its status is the error code it ended with, or ``ok``."""
        start = time.perf_counter()
        status = "ok"
        try:
            yield
        except Exception as exc:
            status = getattr(exc, "code", type(exc).__name__)
            raise
        finally:
            self.latency.labels(name).observe(time.perf_counter() - start)
            self.ops.labels(name, status).inc()

    def add_tokens(self, op: str, count: int) -> None:
        if count > 0:
            self.tokens.labels(op).inc(count)

    def exposition(self, jobs: list[tuple[str, str, int]]) -> bytes:
        """The text a scrape gets: the op series and the gauges of ``jobs``, the ``(job_id,
        state, ops in flight)`` of the jobs this caller may see."""
        return generate_latest(_Scrape(self.registry, jobs))


class _Scrape(Collector):
    """One scrape's families: the registry's, then the job gauges of the caller's jobs."""

    def __init__(self, registry: CollectorRegistry, jobs: list[tuple[str, str, int]]) -> None:
        self._registry = registry
        self._jobs = jobs

    def collect(self):
        yield from self._registry.collect()
        jobs = self._jobs
        depth = GaugeMetricFamily(
            "arctic_queue_depth", "Ops submitted to a job and not finished.", labels=["job_id"]
        )
        states = GaugeMetricFamily("arctic_jobs", "Jobs by state.", labels=["state"])
        for job_id, _, in_flight in jobs:
            depth.add_metric([job_id], in_flight)
        for state, count in sorted(collections.Counter(s for _, s, _ in jobs).items()):
            states.add_metric([state], count)
        yield depth
        yield states
