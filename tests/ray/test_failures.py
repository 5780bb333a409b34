"""A failing worker fails its job only: the server-state actor, other jobs and new jobs go on.

Job A (2 training workers) belongs to a client; jobs B and C are created on the same server-state
actor through its own API, as a second user of the same server would. Killing one of A's workers
(``ray.kill``) fails A with a reason naming the dead worker and kills A's other worker. A bad save
path is refused before it reaches a worker, and a save the filesystem refuses inside a worker
fails only that request: B goes on. Bad configuration is refused with errors that name the
setting.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from arctic_platform.client import ServerError, create_arctic_rl_client
from arctic_platform.client.config import ArcticRLClientConfig
from arctic_platform.contract.ops import OpName
from arctic_platform.layout import training_batch
from tests.ray.cluster import ray_backend
from tests.waiting import wait_until

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

TINY = "builtin:tiny"


def config(data_dir, **backend) -> dict:
    return {"model": TINY, "seed": 1, "backend": ray_backend(data_dir, **backend)}


def job_body(workers: int) -> dict:
    """A create-job body for a training job with ``workers`` workers, as the client sends it."""
    body = ArcticRLClientConfig.model_validate({"model": TINY, "seed": 1})
    spec = body.create_job_body()
    spec["sub_job_configs"][0]["training_config"]["n_gpus"] = workers
    return spec


def ask(state, method: str, *args):
    kind, value = ray.get(getattr(state, method).remote(*args))
    assert kind == "ok", (method, value)
    return value


def start_job(state, workers: int) -> tuple[str, dict]:
    """A new job's id and its state once it runs or ends (the job ops, as a client sends them)."""
    job_id = ask(state, "execute", "", OpName.CREATE_JOB, job_body(workers))["job_ids"][0]
    status = {"status": "pending"}
    while status["status"] in ("pending", "initializing"):
        status = ask(state, "execute", job_id, OpName.GET_JOB, {"wait_s": 30})
    return job_id, status


def create_job(state, workers: int) -> str:
    job_id, status = start_job(state, workers)
    assert status["status"] == "running", status
    return job_id


BATCH = {
    "batch": training_batch(
        [[40, 41, 42], [50, 51]],
        [[60, 61, 62, 63], [70, 71]],
        pad_token_id=0,
        advantages=[1.0, -1.0],
    ),
    "processing": {"loss_fn": "verl_grpo"},
}
BATCH["batch"]["old_log_probs"] = np.full(BATCH["batch"]["input_ids"].shape, -4.0, np.float32)


def wait_dead(actor, timeout: float = 60.0) -> None:
    def dead() -> bool:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return True
        return False

    wait_until(dead, what="the actor is still alive", timeout_s=timeout, interval_s=0.2)


@pytest.fixture(scope="module")
def client(ray_cluster, tmp_path_factory):
    client = create_arctic_rl_client(
        config(tmp_path_factory.mktemp("a"), num_training_workers=2), blocking_calls=True
    )
    yield client
    client.shutdown()


def test_a_killed_worker_fails_its_job_and_nothing_else(client, tmp_path):
    state = client.get_server_state()
    assert client.fwd_bwd(BATCH)["loss"] != 0
    job_b = create_job(state, workers=1)
    workers = ask(state, "actors", client.training_job_id)
    assert len(workers) == 2

    ray.kill(workers[1])
    with pytest.raises(ServerError) as info:
        client.step()
    assert info.value.status == 500
    assert "training worker 1 of 2" in info.value.message and "died" in info.value.message
    job_a = ask(state, "get_job", client.training_job_id)
    assert job_a["status"] == "failed"
    assert "training worker 1 of 2" in job_a["reason"]
    wait_dead(workers[0])  # the job's other worker was cleaned up, not left in a collective

    # The server and the other job carry on; a new job can be created and trains.
    step_b = ask(state, "execute", job_b, "step", {})
    assert step_b["global_steps"] == 1
    job_c = create_job(state, workers=2)
    assert ask(state, "execute", job_c, "forward-backward", BATCH)["loss"] != 0
    assert ask(state, "execute", job_c, "step", {})["global_steps"] == 1
    assert {j["job_id"]: j["status"] for j in ask(state, "list_jobs")} == {
        client.training_job_id.split(":")[0]: "failed",
        job_b: "running",
        job_c: "running",
    }

    # A name too long to create is refused before it reaches a worker; a save the filesystem
    # refuses inside the worker (its folder would be under a file) fails only that request.
    kind, error = ray.get(state.execute.remote(job_b, "save", {"path": "x" * 300}))
    assert kind == "error" and error["status"] == 400 and "save.path" in error["message"]
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    kind, error = ray.get(state.execute.remote(job_b, "save", {"path": str(blocker / "run")}))
    assert kind == "error" and error["status"] == 400, error
    assert "Not a directory" in error["message"]
    assert ask(state, "get_job", job_b)["status"] == "running"
    assert ask(state, "execute", job_b, "step", {})["global_steps"] == 2
    assert ask(state, "execute", job_c, "step", {})["global_steps"] == 2
    ask(state, "execute", job_c, OpName.CANCEL_JOB, None)


def test_a_job_larger_than_the_cluster_fails_naming_the_setting(client):
    state = client.get_server_state()
    job_id, status = start_job(state, workers=8)
    assert status["status"] == "failed"
    reason = ask(state, "get_job", job_id)["reason"]
    assert "training_config.n_gpus: the job needs 2.72 CPU" in reason
    assert "the Ray cluster has 2 CPU in total" in reason


def test_conflicting_worker_counts_are_refused_before_anything_starts(tmp_path):
    bad = config(tmp_path, num_training_workers=2)
    bad["training"] = {"n_gpus": 3}
    with pytest.raises(ValueError, match=r"num_training_workers: 2 disagrees with training.n_gpus"):
        create_arctic_rl_client(bad)


def test_server_state_must_come_with_job_ids(tmp_path):
    with pytest.raises(ValueError, match="reconnecting also needs the job ids"):
        create_arctic_rl_client(config(tmp_path), server_state=object())


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1:1", "backend.address: no Ray cluster answers at '127.0.0.1:1'"),
        ("not-an-address", "backend.address: 'not-an-address' is not a Ray address"),
    ],
)
def test_an_unreachable_address_fails_at_once(tmp_path, address, message):
    """In a fresh process (no Ray running there): the client does not hang retrying."""
    code = (
        "from arctic_platform.client import create_arctic_rl_client\n"
        f"cfg = {config(tmp_path, address=address)!r}\n"
        "try:\n"
        "    create_arctic_rl_client(cfg)\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert message in result.stdout


def test_conflicting_data_parallel_choices_are_refused_before_anything_starts(tmp_path):
    bad = config(tmp_path, data_parallel="ddp")
    bad["training"] = {"data_parallel": "fsdp"}
    with pytest.raises(ValueError, match="backend.data_parallel: ddp disagrees with"):
        create_arctic_rl_client(bad, blocking_calls=True)
