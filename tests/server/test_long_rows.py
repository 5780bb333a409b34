"""A row longer than the model's context is refused at submit on every surface, and a running op
stops within one transformer block of a cancel, even when it is one long row (no next microbatch
to stop at)."""

from __future__ import annotations

import httpx
import pytest
import torch

from arctic_platform import wire
from arctic_platform.engine.builtin import BUILTIN_MODELS
from arctic_platform.engine.cancellation import CancelToken
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.server.errors import BadRequest, Conflict
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, OCTET, make_app
from tests.server.test_paths import running

CONTEXT = BUILTIN_MODELS["tiny"].max_position_embeddings


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Service with one running training job, served over 127.0.0.1."""
    service = Service(ServiceSettings(data_dir=tmp_path_factory.mktemp("data"), device="cpu"))
    try:
        job_id = running(service, None)
        with serve_app(make_app(service)) as url, httpx.Client(base_url=url, timeout=120) as http:
            yield service, job_id, http
    finally:
        service.close()


def rows(real: int, width: int) -> dict:
    """One row of ``real`` tokens, right-padded to ``width``, with an SFT loss's labels."""
    ids = torch.randint(1, 50, (1, width))
    mask = torch.zeros(1, width, dtype=torch.long)
    mask[0, :real] = 1
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def trainer_of(service: Service, job_id: str):
    return service.resolve(job_id, owner=None, kind="training").engine


def gradients(engine) -> list:
    return [p.grad for p in engine.model.parameters() if p.requires_grad]


def test_a_row_longer_than_the_context_is_a_400_at_submit_on_every_surface(served):
    service, job_id, http = served
    engine = trainer_of(service, job_id)
    long = {"batch": rows(CONTEXT + 1, CONTEXT + 1)}
    frame = wire.dumps(long)
    for op, route in (("forward-backward", "forward-backward"), ("forward", "forward-no-grad")):
        onprem = http.post(f"/{op}?job_id={job_id}", content=frame, headers=OCTET)
        assert onprem.status_code == 400, onprem.text
        assert onprem.json()["field"] == "batch.input_ids"
        assert (
            f"{CONTEXT + 1} tokens, more than the model's context of {CONTEXT}"
            in (onprem.json()["message"])
        )
        cortex = http.post(f"{CORTEX}/{job_id}/{route}", content=frame, headers=OCTET)
        assert cortex.status_code == 400 and "batch.input_ids" in cortex.json()["message"]
        with pytest.raises(BadRequest, match="context of 1024") as refused:
            service.execute(job_id, op, long)
        assert refused.value.details["field"] == "batch.input_ids"
    # an in-process caller of the engine itself gets the same rule
    with pytest.raises(EngineInputError, match="context of 1024") as caught:
        engine.forward_backward(long["batch"])
    assert caught.value.field == "batch.input_ids"
    # nothing was queued or run, and no gradient appeared
    assert service.get_job(job_id)["last_op"] is None
    assert all(g is None for g in gradients(engine))
    # padding never counts: a full-context row in a wider batch runs
    padded = service.execute(job_id, "forward", {"batch": rows(CONTEXT, CONTEXT + 64)})
    assert padded["batch"]["logprobs"].shape == (1, CONTEXT + 64)


def stop_after_first_block(engine, stop) -> torch.utils.hooks.RemovableHandle:
    """A hook that calls ``stop()`` when the model's first transformer block has run: the op is
    then inside its one microbatch, past any microbatch boundary."""
    blocks = engine.model._no_split_modules
    first = next(m for m in engine.model.modules() if type(m).__name__ in blocks)
    return first.register_forward_hook(lambda *_: stop())


def test_a_cancelled_single_row_fwd_bwd_stops_inside_its_forward(served):
    service, job_id, _ = served
    engine = trainer_of(service, job_id)
    sub = service.resolve(job_id, owner=None, kind="training")
    body = {"batch": rows(64, 64)}  # one row: a single microbatch
    token = CancelToken()
    hook = stop_after_first_block(engine, lambda: token.cancel("request r1 was cancelled"))
    try:
        future = service.submit(sub, "forward-backward", body, stop=token)
        error = future.exception(timeout=120)
    finally:
        hook.remove()
    assert isinstance(error, Conflict) and error.code == "op_cancelled", error
    assert "request r1 was cancelled" in error.message
    assert all(g is None for g in gradients(engine)), "a stopped fwd_bwd left gradients"
    assert service.get_job(job_id)["status"] == "running"
    done = service.execute(job_id, "forward-backward", body)
    assert done["loss"] > 0


def test_cancelling_the_job_stops_its_running_single_row_op_over_http(served):
    service, _, http = served
    job_id = running(service, None)
    engine = trainer_of(service, job_id)
    hook = stop_after_first_block(engine, lambda: service.cancel_job(job_id))
    try:
        frame = wire.dumps({"batch": rows(64, 64)})
        answer = http.post(f"/forward-backward?job_id={job_id}", content=frame, headers=OCTET)
    finally:
        hook.remove()
    assert answer.status_code == 409 and answer.json()["code"] == "op_cancelled", answer.text
    assert service.get_job(job_id)["status"] == "cancelled"
