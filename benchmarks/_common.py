"""Shared helpers for the benchmark scripts: timing, machine facts, writing results.

Every benchmark reports speed as a ratio to a baseline measured in the same run, so results stay
comparable across machines; absolute numbers are recorded beside them for context.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def median_seconds(fn: Callable[[], object], *, repeat: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs after ``warmup`` discarded runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> dict:
    """What the numbers were measured on."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


def write_result(name: str, result: dict) -> Path:
    """Print ``result`` as JSON and write it to ``benchmarks/results/<name>.json``."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    text = json.dumps({"benchmark": name, "machine": machine(), **result}, indent=2)
    path.write_text(text + "\n")
    print(text)
    return path
