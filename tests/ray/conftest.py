"""Fixtures of the Ray backend tests: the shared 2-CPU test cluster."""

from __future__ import annotations

import pytest

from tests.ray.cluster import start_ray


@pytest.fixture(scope="session")
def ray_cluster():
    pytest.importorskip("ray")
    start_ray()
