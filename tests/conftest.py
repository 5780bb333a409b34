"""Test-wide settings: no model hub, one compute thread per test worker."""

import os

# Tests never reach a model hub: built-in models are created locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# The suite runs on two pytest-xdist workers (pyproject's addopts), one per core of the 2-core
# machines it is sized for: each worker, and every process it starts (servers, Ray workers,
# vLLM), computes on one thread, so the workers do not fight over the cores (OpenMP threads spin
# while they wait for work).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Files holding a slow test run first, the rest after (each group in its usual order).

    ``--dist loadfile`` hands whole files to whichever worker is free, in collection order
    (pyproject's ``--no-loadscope-reorder`` keeps this order instead of xdist's "most tests
    first"). Started early, the long files overlap each other, and the many short ones even out
    the end; left late, one long file kept a worker busy for minutes after the other finished.
    """
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)
