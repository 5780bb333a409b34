"""Placement on a busy or too-small Ray cluster: fail at once, or wait and say why, or stop.

On the shared 2-CPU test cluster: job A (one training worker) runs; a placement group the test
creates holds all but 0.2 of the remaining CPU, so job B (one worker, 0.34 CPU) must wait. B's log
says what it waits for and that A holds resources; cancelling B removes its pending placement
group at once (no wait for the placement timeout). A server with a one-second placement timeout
fails such a job naming ``--placement-timeout``. A demand no node can ever hold (a GPU bundle on
this CPU-only cluster) fails as soon as Ray reports it infeasible; with ``autoscaling`` it waits.
(A job larger than the cluster's total CPU fails naming the setting: tests/ray/test_failures.py.)
"""

from __future__ import annotations

import pytest

from arctic_platform.engine.cancellation import CancelToken, OpCancelled, scope
from arctic_platform.server.ray_placement import JobShape, Placement, PlacementWait
from arctic_platform.server.service import Service, ServiceSettings
from tests.server.conftest import sub_job
from tests.waiting import wait_until

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ONE_WORKER = {"sub_job_configs": [sub_job("training", training_config={"n_gpus": 1})]}


def log_of(service: Service, job_id: str) -> str:
    return "\n".join(service.tail_logs(job_id, max_lines=1000)["entries"])


def pending_groups() -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [g for g, row in placement_group_table().items() if row["state"] == "PENDING"]


def settings(path, **extra) -> ServiceSettings:
    return ServiceSettings(data_dir=path, device="cpu", engine_backend="ray", **extra)


@pytest.fixture(scope="module")
def busy(ray_cluster, tmp_path_factory):
    """A server whose job A runs, on a cluster with less than one worker's share free."""
    from ray.util.placement_group import placement_group, remove_placement_group

    service = Service(settings(tmp_path_factory.mktemp("busy")))
    job_a = service.create_job(ONE_WORKER)["job_id"]
    service.wait_until_running(job_a, timeout=300)
    free = ray.available_resources().get("CPU", 0.0)
    holder = placement_group([{"CPU": round(free - 0.2, 4)}])
    ray.get(holder.ready(), timeout=60)
    yield service, job_a
    remove_placement_group(holder)
    service.close()


def test_a_job_waiting_for_busy_resources_says_why_and_a_cancel_frees_them(busy):
    service, job_a = busy
    job_b = service.create_job(ONE_WORKER)["job_id"]
    line = wait_until(
        lambda: "waiting for Ray resources" in log_of(service, job_b),
        what="B's note",
        interval_s=0.05,
    )
    log = log_of(service, job_b)
    assert line and "waiting for Ray resources: 1 bundle(s) (0.34 CPU); " in log
    assert "available now: 0.2 CPU" in log
    assert f"held by job {job_a} (1 bundle(s) (0.34 CPU))" in log
    assert "gives up after 600s" in log
    assert service.get_job(job_b)["status"] == "initializing"
    assert len(pending_groups()) == 1

    service.cancel_job(job_b)
    wait_until(
        lambda: pending_groups() == [],
        what="B's placement group to go",
        timeout_s=10,
        interval_s=0.05,
    )
    wait_until(
        lambda: "initialization stopped" in log_of(service, job_b),
        what="B's build to stop",
        interval_s=0.05,
    )
    assert service.get_job(job_b)["status"] == "cancelled"
    assert service.get_job(job_a)["status"] == "running"


def test_the_operator_timeout_bounds_the_wait(busy, tmp_path):
    impatient = Service(settings(tmp_path, placement_timeout_s=1.0))
    try:
        job = impatient.create_job(ONE_WORKER)["job_id"]
        wait_until(
            lambda: impatient.get_job(job)["status"] == "failed",
            what="the timeout",
            interval_s=0.05,
        )
        reason = impatient.get_job(job)["reason"]
        assert "1 bundle(s) (0.34 CPU) were not free within 1s (serve --placement-timeout)" in (
            reason
        )
        assert pending_groups() == []
    finally:
        impatient.close()


def wait_for(notes: list, *, timeout_s: float = 300.0, autoscaling: bool = False):
    return PlacementWait(
        timeout_s=timeout_s, note=notes.append, holders=lambda: "", autoscaling=autoscaling
    )


def gpu_worker() -> Placement:
    """One training worker on a GPU: a bundle no node of the CPU-only test cluster can hold."""
    return Placement(use_gpu=True, shape=JobShape(training_workers=1), colocate=False)


def test_a_bundle_ray_reports_infeasible_fails_at_once(ray_cluster):
    notes: list[str] = []
    with pytest.raises(ValueError) as info:
        gpu_worker().reserve(wait_for(notes))
    message = str(info.value)
    assert message.startswith("training_config.n_gpus: the job needs 1 GPU (1 training worker")
    assert "the Ray cluster has 0 GPU in total" in message
    assert "Ray reports the placement infeasible" in message
    assert pending_groups() == []


def test_with_autoscaling_an_infeasible_bundle_waits_and_a_cancel_stops_it(ray_cluster):
    notes: list[str] = []
    token = CancelToken()
    with pytest.raises(TimeoutError, match="not free within 1s"):
        gpu_worker().reserve(wait_for(notes, timeout_s=1.0, autoscaling=True))
    assert any("no node can hold it yet: waiting for the autoscaler" in n for n in notes)

    token.cancel("job j was cancelled")
    with pytest.raises(OpCancelled, match="job j was cancelled"), scope(token):
        gpu_worker().reserve(wait_for(notes, autoscaling=True))
    assert pending_groups() == []
