"""What an engine's failure costs. An exception nobody anticipated in an op that leaves its engine
as it found it (``Op.keeps_engine_state``: generate, log-probs, forward, save) fails that request
alone: a 500 naming its request id on every surface, the job's log saying it goes on, and the
next request answered. In an op that may have changed the engine part-way (forward-backward,
step), or when the engine itself broke (a dead worker, a device fault), it fails the job."""

from __future__ import annotations

import pytest
import torch

from arctic_platform.contract.ops import OPS, OpName
from arctic_platform.engine.errors import EngineBroken
from arctic_platform.layout import training_batch
from arctic_platform.server.errors import EngineFailure
from tests.server.conftest import CORTEX
from tests.server.test_error_model import SECRET, broken, polled_to_the_end

GENERATE = {"prompts": ["1+2="], "sampling_params": {"max_tokens": 2}}


@pytest.fixture
def service(fake_service):
    return fake_service


def test_which_ops_keep_their_engine_state():
    keeping = {name for name, op in OPS.items() if op.keeps_engine_state}
    assert keeping == {
        OpName.FORWARD,
        OpName.GENERATE,
        OpName.GENERATE_STREAM,
        OpName.LOG_PROBS,
        OpName.TOKENIZE,
        OpName.SAVE,
    }


def test_a_bug_in_a_generate_or_log_probs_fails_the_request_and_the_job_goes_on(
    http, service, running_job, monkeypatch
):
    sampler = service.resolve(running_job, owner=None, kind="sampling").engine
    scorer = service.resolve(running_job, owner=None, kind="log_prob").engine
    healthy = sampler.generate
    monkeypatch.setattr(sampler, "generate", broken)
    monkeypatch.setattr(scorer, "log_probs", broken)

    onprem = http.post(f"/generate?job_id={running_job}", json=GENERATE)
    assert onprem.status_code == 500, onprem.text
    assert onprem.json()["code"] == "internal_error"
    assert onprem.json()["request_id"] == onprem.headers["x-request-id"]
    scoring = http.post(f"{CORTEX}/{running_job}/log-probs", json={"prompts": ["1+2="]})
    request_id = scoring.json()["request_id"]
    cortex = polled_to_the_end(http, running_job, request_id)
    assert cortex["status"] == "failed"
    assert cortex["error_detail"]["code"] == "internal_error"
    assert cortex["error_detail"]["request_id"] == request_id
    for answer in (onprem.text, str(cortex)):
        assert SECRET not in answer and "RuntimeError" not in answer

    assert service.get_job(running_job)["status"] == "running"
    logged = "\n".join(service.tail_logs(running_job)["entries"])
    for op in ("generate", "log-probs"):
        assert f"{op} failed on" in logged
    assert "the job goes on" in logged
    monkeypatch.setattr(sampler, "generate", healthy)
    again = http.post(f"/generate?job_id={running_job}", json=GENERATE)
    assert again.status_code == 200, again.text


def test_a_bug_in_a_forward_backward_fails_the_job(service, running_job, monkeypatch):
    trainer = service.resolve(running_job, owner=None, kind="training").engine
    monkeypatch.setattr(trainer, "forward_backward", broken)
    batch = training_batch([[1, 2, 3]], [[4, 5]], pad_token_id=0, advantages=[1.0])
    with pytest.raises(EngineFailure, match="forward-backward failed"):
        service.execute(running_job, OpName.FORWARD_BACKWARD, {"batch": batch})
    assert service.get_job(running_job)["status"] == "failed"


@pytest.mark.parametrize(
    "error",
    [EngineBroken("the worker process died"), torch.AcceleratorError("device-side assert")],
    ids=["engine-broken", "device-fault"],
)
def test_a_generate_that_broke_its_engine_fails_the_job(service, running_job, monkeypatch, error):
    def breaking(*_args, **_kwargs):
        raise error

    sampler = service.resolve(running_job, owner=None, kind="sampling").engine
    monkeypatch.setattr(sampler, "generate", breaking)
    with pytest.raises(EngineFailure, match="generate failed"):
        service.execute(running_job, OpName.GENERATE, GENERATE)
    assert service.get_job(running_job)["status"] == "failed"
