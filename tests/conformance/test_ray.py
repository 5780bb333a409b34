"""The conformance script on the Ray backend: the same answers as in-process on the same engine.

Ray runs its Service in the server-state actor and the engines in actors of their own, where
FakeEngine cannot reach, so this surface runs the real engine (``builtin:tiny``, one training
worker, whose arithmetic is the in-process engine's) and is held to the in-process run of the
real engine: the same results, bit for bit, and the same refusals. On the shared test cluster
(``tests/ray/cluster.py``).
"""

from __future__ import annotations

import pytest

from arctic_platform.client import create_arctic_rl_client
from tests.conformance.script import NAMED, run_script, same
from tests.conformance.surfaces import client_config
from tests.conformance.test_surfaces import OPS

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_answers(tmp_path_factory) -> dict:
    from tests.ray.cluster import ray_backend, start_ray

    start_ray()
    config = client_config(ray_backend(tmp_path_factory.mktemp("ray")))
    with create_arctic_rl_client(config, blocking_calls=True) as client:
        return run_script(client)


@pytest.mark.parametrize("op", OPS)
def test_ray_gives_the_in_process_result(ray_answers, torch_answers, op):
    assert same(ray_answers[op], torch_answers[op]), (ray_answers[op], torch_answers[op])


@pytest.mark.parametrize("op", NAMED)
def test_ray_refuses_a_bad_request_as_in_process(ray_answers, torch_answers, op):
    *answer, message = ray_answers[op]
    assert answer == list(torch_answers[op][:3])
    assert NAMED[op] in message
