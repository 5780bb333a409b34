"""A lost Ray node fails only the job that ran there, naming the node; the rest goes on.

A local multi-node cluster (``ray.cluster_utils.Cluster``): a head node, where this process (the
driver, holding the Service) runs, and two worker nodes. Every node is bound to 127.0.0.1 and the
driver connects there, so no traffic leaves loopback. By default Ray rewrites a loopback address
given to ``ray.init`` into the machine's interface address (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
is its switch, read when Ray is imported), and a head bound to 127.0.0.1 does not answer there;
the module turns that rewrite off while it runs. Its Ray files live in a private temp dir
(``RAY_TMPDIR``), and a cluster the other Ray tests share is stopped for the module and started
again after it.

The layout is forced, not left to the scheduler: every node can hold exactly one training
worker's CPU share (placement groups pinned to each node by a custom resource hold the rest).
Job B (one worker) is created while the head is the only node, so it runs there; then the worker
nodes join and DDP job A's two workers can only go one to each. While A's worker on the second
worker node runs a ``forward_backward`` (its process title shows it), that node is removed
abruptly (every process of it killed, as when a machine fails: Ray declares it dead only when its
health checks fail, seconds later, and meanwhile the surviving worker's collective breaks and the
lost one is merely unreachable):

* the op fails with an answer naming the node (its id and 127.0.0.1) and the worker that ran
  there, not a Ray traceback, and A's ``reason`` says the same;
* A's surviving worker is killed (not left in a collective) and A's placement group removed;
* B still trains; a new job C starts on what is left and trains.

The module checks, last, that no process of the cluster is left behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading

import numpy as np
import pytest

from arctic_platform.layout import training_batch
from arctic_platform.server.errors import EngineFailure
from arctic_platform.server.ray_placement import SHARES
from arctic_platform.server.service import Service, ServiceSettings
from tests.ray.cluster import start_ray
from tests.server.conftest import sub_job
from tests.waiting import wait_until

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.slow

LOOPBACK = "127.0.0.1"
WAIT_S = 300.0
# Each node keeps one training worker's share free, not two: the rest of its one CPU is held.
HELD_CPU = round(1.0 - 1.5 * SHARES["training"], 4)


def job_spec(workers: int) -> dict:
    return {"sub_job_configs": [sub_job("training", training_config={"n_gpus": workers})]}


def batch(rows: int, prompt: int, response: int) -> dict:
    rng = np.random.default_rng(rows)
    data = training_batch(
        [rng.integers(5, 90, prompt).tolist() for _ in range(rows)],
        [rng.integers(5, 90, response).tolist() for _ in range(rows)],
        pad_token_id=0,
        advantages=rng.normal(size=rows).astype(np.float32),
    )
    data["old_log_probs"] = np.full(data["input_ids"].shape, -4.0, np.float32)
    return {"batch": data, "processing": {"loss_fn": "verl_grpo"}}


SMALL = batch(2, 3, 4)
# Seconds of compute for each of two workers on one core: long enough to be removed under.
BIG = batch(12, 100, 400)


def node_args(num_cpus: int, name: str) -> dict:
    """A node bound to 127.0.0.1 with one CPU and a resource naming it (to pin a holder)."""
    return {
        "node_ip_address": LOOPBACK,
        "num_cpus": num_cpus,
        "resources": {name: 1},
        "include_dashboard": False,
    }


def hold_cpu(name: str):
    """A placement group holding ``HELD_CPU`` of node ``name`` (see module doc)."""
    from ray.util.placement_group import placement_group

    group = placement_group([{"CPU": HELD_CPU, name: 1}])
    ray.get(group.ready(), timeout=WAIT_S)
    return group


def node_processes(node) -> list:
    """The live processes a cluster node started, and their children (its Ray workers)."""
    found = []
    for infos in node.all_processes.values():
        for info in infos:
            try:
                process = psutil.Process(info.process.pid)
                found += [process, *process.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    return found


def running(node, method: str) -> bool:
    """Whether a worker process of ``node`` is running an actor's ``method`` now (Ray puts the
    task's name in the process title)."""
    for process in node_processes(node):
        try:
            if any(method in part for part in process.cmdline()):
                return True
        except psutil.Error:
            pass
    return False


def group_of(job_id: str) -> dict:
    from ray.util.placement_group import placement_group_table

    rows = [row for row in placement_group_table().values() if job_id in row["name"]]
    assert len(rows) == 1, rows
    return rows[0]


def wait_dead(actor) -> None:
    def dead() -> bool:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        return False

    wait_until(dead, what="the actor to die", timeout_s=WAIT_S, interval_s=0.05)


def cluster_processes(temp_dir: str) -> list:
    """Every live process of the module's cluster: they all inherit its ``RAY_TMPDIR``."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get("RAY_TMPDIR") == temp_dir:
                found.append(process)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def cluster():
    """The head node, this process connected to it; stopped and checked afterwards."""
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    was_running = ray.is_initialized()
    if was_running:
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a limit
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_TMPDIR", temp_dir)
        patch.setenv("RAY_AUTH_MODE", "disabled")
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # keep 127.0.0.1 (module doc)
        cluster = Cluster(shutdown_at_exit=True)
        try:
            cluster.add_node(**node_args(1, "head"))
            ray.init(
                address=cluster.address,
                _node_ip_address=LOOPBACK,
                include_dashboard=False,
                log_to_driver=False,
            )
            assert cluster_processes(temp_dir), "the leftover check would see nothing"
            yield cluster
        finally:
            try:
                ray.shutdown()
                cluster.shutdown()
            finally:
                with contextlib.suppress(AssertionError):  # the stragglers are killed below
                    wait_until(
                        lambda: not cluster_processes(temp_dir),
                        what="the cluster's processes ending",
                        timeout_s=60,
                        interval_s=0.2,
                    )
                left = cluster_processes(temp_dir)
                for process in left:  # ours (they carry our RAY_TMPDIR); reported below
                    process.kill()
                shutil.rmtree(temp_dir, ignore_errors=True)
    if was_running:
        start_ray()
    assert not left, f"the cluster left processes behind: {left}"


def test_a_lost_node_fails_only_its_job_naming_the_node(cluster, tmp_path):
    assert ray.get_runtime_context().gcs_address.startswith(f"{LOOPBACK}:")
    assert ray.util.get_node_ip_address() == LOOPBACK  # the driver's own address

    hold_cpu("head")
    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu", engine_backend="ray"))
    try:
        job_b = service.create_job(job_spec(1))["job_id"]
        service.wait_until_running(job_b, timeout=WAIT_S)

        workers = [cluster.add_node(**node_args(1, name)) for name in ("w1", "w2")]
        for name in ("w1", "w2"):
            hold_cpu(name)
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {LOOPBACK}
        job_a = service.create_job(job_spec(2))["job_id"]
        service.wait_until_running(job_a, timeout=WAIT_S)
        on_node = group_of(job_a)["bundles_to_node_id"]  # bundle r holds training rank r
        assert sorted(on_node.values()) == sorted(w.node_id for w in workers)
        lost = workers[1]
        rank = next(r for r, node in on_node.items() if node == lost.node_id)
        survivor = service.resolve(job_a, owner=None).engine.actors.handles[1 - rank]

        answer: dict = {}

        def train() -> None:
            try:
                answer["ok"] = service.execute(job_a, "forward-backward", BIG)
            except EngineFailure as exc:
                answer["error"] = exc

        op = threading.Thread(target=train)
        op.start()
        wait_until(
            lambda: running(lost, "forward_backward"),
            what="A's worker there to run the op",
            timeout_s=WAIT_S,
            interval_s=0.05,
        )
        cluster.remove_node(lost, allow_graceful=False)  # SIGKILL: see module doc
        op.join(WAIT_S)
        assert not op.is_alive(), "the op on the lost node never answered"

        assert "error" in answer, f"the op ended before its node was removed: {answer}"
        error = answer["error"]
        assert error.status == 500
        expected = f"node {lost.node_id} ({LOOPBACK}) lost during forward-backward"
        assert expected in error.message
        assert f"it ran training worker {rank} of 2" in error.message
        assert "Traceback" not in error.message
        job = service.get_job(job_a)
        assert job["status"] == "failed"
        assert expected in job["reason"]
        wait_dead(survivor)  # killed, not left waiting in a collective for its lost peer
        wait_until(
            lambda: group_of(job_a)["state"] == "REMOVED",
            what="A's placement group to go",
            timeout_s=WAIT_S,
            interval_s=0.05,
        )

        # The server and the other job go on; a new job starts on what is left and trains.
        assert service.execute(job_b, "forward-backward", SMALL)["loss"] != 0
        assert service.execute(job_b, "step", {})["global_steps"] == 1
        job_c = service.create_job(job_spec(1))["job_id"]
        service.wait_until_running(job_c, timeout=WAIT_S)
        assert group_of(job_c)["bundles_to_node_id"][0] == workers[0].node_id
        assert service.execute(job_c, "forward-backward", SMALL)["loss"] != 0
        assert service.execute(job_c, "step", {})["global_steps"] == 1
        assert {j["job_id"]: j["status"] for j in service.list_jobs()} == {
            job_a: "failed",
            job_b: "running",
            job_c: "running",
        }
    finally:
        service.close()
