"""One real Ray cluster for every test that needs it: 2 CPUs, started once per pytest process.

Ray is started lazily by the first test that asks and stopped by Ray's own exit hook, so the
Ray tests and the ray case of the shared client suite share one cluster (startup takes seconds).
Token authentication is off (nothing leaves this machine) and the dashboard is not started.
"""

from __future__ import annotations

import os

NUM_CPUS = 2


def start_ray() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if not ray.is_initialized():
        # address="local": a private cluster, never one that merely runs on this machine
        ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False)


def ray_backend(data_dir, **extra) -> dict:
    """The ``backend:`` section of a test client on the test cluster (engines on CPU)."""
    return {"type": "ray", "data_dir": str(data_dir), "device": "cpu", **extra}
