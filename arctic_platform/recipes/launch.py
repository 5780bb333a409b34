"""Turn ``arctic-platform train`` options into a recipe run: the backend, the run directory,
and for ``--backend http|cortex`` without ``--url`` a local server started for the run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from arctic_platform.recipes.grpo import STATE_FILE

BACKENDS = ("inprocess", "http", "cortex", "ray")
RUNS_DIR = Path("runs")
CORTEX_DATABASE, CORTEX_SCHEMA = "ARCTIC", "RL"


def resolve_run_dir(output_dir: Path | None, *, resume: bool) -> Path:
    """``--output-dir``; for ``--resume`` without it, the newest run with a checkpoint;
    otherwise a new ``runs/<timestamp>``."""
    if output_dir is not None:
        return output_dir
    if resume:
        candidates = sorted(
            (p for p in RUNS_DIR.glob("*") if (p / STATE_FILE).exists()),
            key=lambda p: (p / STATE_FILE).stat().st_mtime,
        )
        if not candidates:
            raise ValueError("--resume: no run with a checkpoint under runs/; pass --output-dir")
        return candidates[-1]
    return RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")


def check_options(backend: str | None, url: str | None) -> None:
    """Reject ``--backend``/``--url`` combinations that cannot work, before anything starts."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"--backend: unknown backend {backend!r}; choose one of {BACKENDS}")
    if url is not None and backend not in ("http", "cortex"):
        raise ValueError("--url: only used with --backend http or --backend cortex")


def backend_settings(backend: str | None, url: str | None) -> dict[str, Any] | None:
    """The client ``backend`` section for checked options (None: keep the recipe's).

    ``url`` is required for http and cortex (see :func:`server_for_run`).
    """
    if backend is None:
        return None
    if backend in ("inprocess", "ray"):
        return {"type": backend}
    if backend == "http":
        return {"type": "http", "url": url}
    return {"type": "cortex", "base_url": url, "database": CORTEX_DATABASE, "schema": CORTEX_SCHEMA}


@contextlib.contextmanager
def server_for_run(backend: str | None, url: str | None, run_dir: Path) -> Iterator[str | None]:
    """``--backend http|cortex`` without ``--url`` starts ``arctic-platform serve`` for the run
    (engine data inside the run directory) and yields its URL; otherwise yields ``url``."""
    if backend not in ("http", "cortex") or url is not None:
        yield url
        return
    from arctic_platform.client.local_server import LocalServer

    with LocalServer(data_dir=run_dir / "engine-data", device="cpu") as server_url:
        yield server_url
