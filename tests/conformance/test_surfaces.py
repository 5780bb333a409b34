"""Each op answers alike on every surface: the same result for the same request, and the same
error (status, code, field) for the same bad request.

The surfaces of ``surfaces.py`` reach one Service whose jobs run on FakeEngine: what is compared
is the server's edges, not the engine's numbers. One parametrisation runs the same script
in-process on the real engine (``builtin:tiny``), to hold the fake to the real engine's result
shapes and error answers.
"""

from __future__ import annotations

import numpy as np
import pytest

from arctic_platform.client import ConflictError
from arctic_platform.server.service import Service, ServiceSettings
from tests.conformance.script import NAMED, protocols_met, run_script, same
from tests.conformance.surfaces import FAKE_SURFACES, fake_surfaces
from tests.fake_engine import build_fake_engine
from tests.live_server import serve_app
from tests.server.conftest import make_app

OPS = (
    "create job",
    "get job",
    "generate",
    "log_probs",
    "forward",
    "fwd_bwd",
    "step",
    "save",
    "forward after step",
    "load",
)


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """The fake-engine Service, served over 127.0.0.1, and a client maker per surface."""
    service = Service(
        ServiceSettings(data_dir=tmp_path_factory.mktemp("server"), device="cpu"),
        engine_builder=build_fake_engine,
    )
    with serve_app(make_app(service)) as url:
        yield service, fake_surfaces(service, url, tmp_path_factory.mktemp("client"))
    service.close()


@pytest.fixture(scope="module")
def answers(fake) -> dict[str, dict]:
    """The script's answers on each fake surface."""
    _, surfaces = fake
    out = {}
    for surface in FAKE_SURFACES:
        with surfaces[surface]() as client:
            out[surface] = run_script(client)
    return out


def shape(value):
    """What a result looks like without its numbers: keys, lengths of lists of records, array
    ranks and dtypes, value types."""
    if isinstance(value, np.ndarray):
        return ("array", value.ndim, str(value.dtype))
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [shape(v) for v in value[:1]]
    return type(value).__name__


@pytest.mark.parametrize("op", OPS)
def test_every_surface_gives_the_same_result(answers, op):
    reference = answers["inprocess"][op]
    for surface in FAKE_SURFACES:
        assert same(answers[surface][op], reference), (surface, answers[surface][op], reference)


@pytest.mark.parametrize("op", NAMED)
def test_every_surface_refuses_a_bad_request_alike(answers, torch_answers, op):
    """The same status, code and field everywhere, the real engine included, and a message
    naming what is wrong."""
    refusals = {surface: answers[surface][op] for surface in FAKE_SURFACES}
    refusals["torch"] = torch_answers[op]
    status, code, field, _ = refusals["inprocess"]
    assert 400 <= status < 500 and code and field, refusals
    for surface, (*answer, message) in refusals.items():
        assert answer == [status, code, field], (surface, refusals)
        assert NAMED[op] in message, (surface, message)


@pytest.mark.parametrize("op", OPS)
def test_the_fake_answers_in_the_real_engines_shapes(answers, torch_answers, op):
    fake, real = answers["inprocess"][op], torch_answers[op]
    if op in ("fwd_bwd",):  # the metrics are the loss's own: the fake has only ``loss``
        fake, real = {**fake, "metrics": {}}, {**real, "metrics": {}}
    assert shape(fake) == shape(real)


def test_the_fake_engine_changes_with_the_ops(answers):
    """The script's numbers depend on the ops run: a step changes the log-probs, a load of the
    checkpoint saved after it restores its step."""
    run = answers["inprocess"]
    assert not same(run["forward after step"], run["forward"])
    assert run["step"]["global_steps"] == 1 == run["load"]["global_step"]
    assert run["generate"][0]["token_ids"] != run["generate"][1]["token_ids"]


def test_the_real_and_the_fake_engines_implement_the_engine_protocols(fake, torch_answers):
    service, surfaces = fake
    with surfaces["inprocess"]() as client:
        fake_met = protocols_met(service, client)
    expected = {"training": True, "sampling": True, "log_prob": True}
    assert fake_met == expected
    assert torch_answers["protocols"] == expected


@pytest.mark.parametrize("surface", FAKE_SURFACES)
def test_closing_a_client_cancels_its_job_on_every_surface(fake, surface):
    service, surfaces = fake
    client = surfaces[surface]()
    job_id = client.training_job_id.split(":")[0]
    reconnect = client.reconnect_config()
    client.close()
    assert service.get_job(job_id)["status"] == "cancelled"
    with pytest.raises(ConflictError) as refused:
        surfaces[surface](reconnect)
    assert (refused.value.status, refused.value.code) == (409, "job_cancelled")
