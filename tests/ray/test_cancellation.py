"""Cancelling an op that runs in Ray actors stops it there, and the job goes on.

One job on the Ray backend: a training sub-job over 2 data-parallel workers (DDP) and a sampling
replica. A request's own token (what a Cortex ``cancel-request`` sets) stops a running generate
in its replica and a running ``forward-backward`` on both ranks; the next ops then run on the
same actors (no rank is left waiting in a collective), and the step after the stopped
``forward-backward`` has the gradient of the earlier batch only: its grad norm equals the one an
in-process engine computes for that batch alone. Cancelling the job stops its running generate
with the same 409.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from arctic_platform.engine.cancellation import CancelToken
from arctic_platform.engine.errors import EngineBroken
from arctic_platform.layout import training_batch
from arctic_platform.server.ray_engines import WorkerFailure, WorkerRaised, _Actors
from arctic_platform.server.service import Service, ServiceSettings
from tests.server.conftest import sub_job
from tests.server.test_fair_sharing import ENDLESS, ended_by, endless_generate, started

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

# Small microbatches: the long batch below runs hundreds of model calls per rank.
TRAINING = {"optimizer": {"name": "AdamW", "lr": 1e-3}, "max_tokens_per_microbatch": 64}


def batch(rows: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, 100, 24)) for _ in range(rows)]  # distinct: no sharing
    responses = [list(rng.integers(3, 100, 24)) for _ in range(rows)]
    advantages = rng.standard_normal(rows).tolist()
    out = training_batch(prompts, responses, pad_token_id=0, advantages=advantages)
    out["old_log_probs"] = np.full(out["input_ids"].shape, -4.0, np.float32)
    return {"batch": out, "processing": {"loss_fn": "verl_grpo"}}


SMALL = batch(4, 0)
LONG = batch(512, 1)


def start(service: Service, *subs: dict) -> str:
    job_id = service.create_job({"sub_job_configs": list(subs)})["job_id"]
    service.wait_until_running(job_id, timeout=300)
    return job_id


@pytest.fixture(scope="module")
def service(ray_cluster, tmp_path_factory):
    svc = Service(
        ServiceSettings(
            data_dir=tmp_path_factory.mktemp("cancel"), device="cpu", engine_backend="ray"
        )
    )
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def job_id(service):
    return start(
        service,
        sub_job("training", training_config={**TRAINING, "n_gpus": 2}),
        sub_job("sampling"),
    )


def test_a_cancelled_request_stops_a_running_generate_in_its_replica(service, job_id):
    sub = service.resolve(job_id, owner=None, kind="sampling")
    stop = CancelToken()
    body = {"prompts": ["1+2="], "sampling_params": ENDLESS}
    future = service.submit(sub, "generate", body, stop=stop)
    started(service, future, job_id)
    stop.cancel("request r1 was cancelled")
    assert "request r1 was cancelled" in ended_by(future, "op_cancelled")
    short = {"prompts": ["1+2="], "sampling_params": {"max_tokens": 3, "ignore_eos": True}}
    (again,) = service.submit(sub, "generate", short).result(timeout=120)["results"]
    assert len(again["token_ids"]) == 3
    assert service.get_job(job_id)["status"] == "running"


def test_a_stopped_fwd_bwd_adds_no_gradient_on_any_rank(service, job_id, tmp_path):
    sub = service.resolve(job_id, owner=None, kind="training")
    service.submit(sub, "forward-backward", SMALL).result(timeout=120)
    stop = CancelToken()
    future = service.submit(sub, "forward-backward", LONG, stop=stop)
    started(service, future, job_id)
    stop.cancel("request r2 was cancelled")
    assert "request r2 was cancelled" in ended_by(future, "op_cancelled")
    stepped = service.submit(sub, "step", {}).result(timeout=120)

    reference = Service(ServiceSettings(data_dir=tmp_path, device="cpu"))
    try:
        local = reference.resolve(
            start(reference, sub_job("training", training_config=TRAINING)),
            owner=None,
            kind="training",
        )
        reference.call(local, "forward-backward", SMALL)
        expected = reference.call(local, "step", {})
    finally:
        reference.close()
    assert stepped["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    # Both ranks are free and in step: the next request runs to its end on each.
    answer = service.submit(sub, "forward-backward", SMALL).result(timeout=120)
    assert np.isfinite(answer["loss"])


def test_a_generate_joins_the_replicas_running_decode(service, job_id):
    """The replica takes calls side by side, so a short generate that arrives while a long one
    decodes joins that decode and returns first, as on our sampler in the server's process
    (before, the actor ran one call at a time and the short one waited for the long)."""
    sub = service.resolve(job_id, owner=None, kind="sampling")
    assert sub.engine.concurrent_generate
    stop = CancelToken()
    long_params = {"max_tokens": 1000, "ignore_eos": True, "temperature": 1.0}
    long = service.submit(
        sub, "generate", {"prompts": ["1+2="], "sampling_params": long_params}, stop=stop
    )
    started(service, long, job_id)
    short = {"prompts": ["1+2="], "sampling_params": {"max_tokens": 3, "ignore_eos": True}}
    (answer,) = service.submit(sub, "generate", short).result(timeout=120)["results"]
    assert len(answer["token_ids"]) == 3
    assert not long.done()  # the short one came back while the long one decoded
    stop.cancel("done with it")
    ended_by(long, "op_cancelled")


def test_a_replica_that_raises_fails_the_request_and_the_job_goes_on(service, job_id, monkeypatch):
    """The replica's engine raises (a keyword its ``generate`` does not take stands in for a
    bug): its actor is alive and idle, so, as in the server's process, a generate (which keeps
    its engine's state) fails alone and the job goes on."""
    engine = service.resolve(job_id, owner=None, kind="sampling").engine
    buggy = functools.partial(engine._call, "generate", unknown_keyword=True)
    monkeypatch.setattr(engine, "generate", buggy, raising=False)
    body = {"prompts": ["1+2="], "sampling_params": {"max_tokens": 2, "ignore_eos": True}}
    with pytest.raises(WorkerRaised, match="TypeError"):
        service.execute(job_id, "generate", body)
    assert service.get_job(job_id)["status"] == "running"
    monkeypatch.undo()
    (answer,) = service.execute(job_id, "generate", body)["results"]
    assert len(answer["token_ids"]) == 2


@pytest.mark.parametrize(
    ("cause", "expected"),
    [(ValueError("a bug"), WorkerRaised), (EngineBroken("vLLM failed a step"), WorkerFailure)],
    ids=["a-bug", "engine-broken"],
)
def test_what_a_replica_that_raised_costs(cause, expected):
    """A replica's exception as Ray hands it over (no peer waits for it): the op alone fails
    (``WorkerRaised``) unless the exception broke its engine (``WorkerFailure``: the job)."""
    ray = pytest.importorskip("ray")
    actors = _Actors("j:sampling:0", "sampling", [None], ["replica"], [None])
    raised = ray.exceptions.RayTaskError("call", "traceback", cause)
    failure = actors._failure(0, raised, "generate", {})
    assert type(failure) is expected and "generate" in str(failure)


def test_cancelling_the_job_stops_its_running_generate(service, job_id):
    future = endless_generate(service, job_id, None)
    service.cancel_job(job_id)
    assert "cancelled" in ended_by(future, "op_cancelled")
    assert service.get_job(job_id)["status"] == "cancelled"
