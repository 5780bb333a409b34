"""One tenant cannot stall the others: request limits, cancellation of ops in flight, per-tenant
fairness in the op scheduler, and a bounded drain on shutdown."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from arctic_platform import wire
from arctic_platform.server.errors import Conflict, PayloadTooLarge
from arctic_platform.server.limits import ServerLimits
from arctic_platform.server.scheduler import FairSlots
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app
from tests.server.conftest import CORTEX, OCTET, job_request, make_app
from tests.server.test_paths import running
from tests.waiting import wait_until

# A generation that runs for minutes on the tiny model: thousands of full-length samples.
ENDLESS = {"n": 2048, "max_tokens": 1000, "ignore_eos": True, "temperature": 1.0}


def started(service: Service, future: Future, job_id: str) -> None:
    """Wait (with a deadline) until ``future``'s op is running on the engine."""

    def running_now() -> bool:
        if future.running():
            return True
        assert not future.done(), future.exception()
        return False

    wait_until(running_now, what=f"the op on job {job_id} running")


def endless_generate(service: Service, job_id: str, owner: str | None) -> Future:
    sub = service.resolve(job_id, owner=owner, kind="sampling")
    future = service.submit(sub, "generate", {"prompts": ["1+2="], "sampling_params": ENDLESS})
    started(service, future, job_id)
    return future


def ended_by(future: Future, code: str) -> str:
    """The message of the error ``future`` ended with (waiting with a deadline)."""
    error = future.exception(timeout=120)
    assert isinstance(error, Conflict) and error.code == code, error
    return error.message


@pytest.mark.parametrize(
    ("op", "body", "limit"),
    [
        ("generate", {"prompts": ["a"], "sampling_params": {"n": 1_000_000}}, "samples_per"),
        (
            "generate",
            {"prompts": ["a", "b"], "sampling_params": {"n": 4, "max_tokens": 100}},
            "sample_tokens",
        ),
        ("generate", {"prompts": ["a"], "sampling_params": {"n": 4}}, "sample_tokens"),
        ("log-probs", {"prompts": ["a"] * 9}, "batch_rows"),
    ],
)
def test_requests_beyond_the_servers_limits_are_413s_naming_the_limit(tmp_path, op, body, limit):
    limits = ServerLimits(
        max_samples_per_request=16, max_sample_tokens=500, max_batch_rows=8, max_batch_tokens=64
    )
    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu", limits=limits))
    try:
        job_id = service.create_job(job_request())["job_id"]
        service.wait_until_running(job_id, timeout=120)
        with serve_app(make_app(service)) as url, httpx.Client(base_url=url) as http:
            route = f"/{op}?job_id={job_id}"
            response = http.post(route, json=body)
            assert response.status_code == 413, response.text
            answer = response.json()
            assert answer["code"] == "limit_exceeded" and limit in answer["limit"]
            assert "--max-" in answer["message"]
            if op == "log-probs":
                cortex = http.post(f"{CORTEX}/{job_id}/log-probs", json=body)
                assert cortex.status_code == 413 and cortex.json()["code"] == "limit_exceeded"
    finally:
        service.close()


def test_training_batches_beyond_the_limits_are_refused_before_they_run(tmp_path):
    import torch

    limits = ServerLimits(max_batch_rows=4, max_batch_tokens=30)
    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu", limits=limits))
    try:
        job_id = running(service, None)
        batch = {"input_ids": torch.ones(2, 16, dtype=torch.long)}  # 32 tokens
        with pytest.raises(PayloadTooLarge, match="max-batch-tokens") as caught:
            service.execute(job_id, "forward", {"batch": batch})
        assert caught.value.code == "limit_exceeded"
        rows = {"input_ids": torch.ones(5, 2, dtype=torch.long)}
        with pytest.raises(PayloadTooLarge, match="max-batch-rows"):
            service.execute(job_id, "forward-backward", {"batch": rows})
    finally:
        service.close()


def test_cancelling_a_job_stops_its_running_generate(service):
    job_id = running(service, None, "sampling")
    future = endless_generate(service, job_id, None)
    service.cancel_job(job_id)
    assert "cancelled" in ended_by(future, "op_cancelled")
    assert service.get_job(job_id)["status"] == "cancelled"


def test_cancel_request_stops_a_running_generate_and_the_job_goes_on(service, http):
    job_id = running(service, None, "sampling")
    generate = f"{CORTEX}/{job_id}/generate"

    def poll(request_id: str, until) -> dict:
        def reached() -> dict | None:
            body = http.get(f"{CORTEX}/{job_id}/requests/{request_id}").json()
            return body if until(body) else None

        return wait_until(reached, what=f"request {request_id}")

    def finished(body: dict) -> bool:
        return body["status"] not in ("pending", "running")

    endless = wire.dumps({"prompts": ["1+2="], "sampling_params": ENDLESS})
    request_id = http.post(generate, content=endless, headers=OCTET).json()["request_id"]
    poll(request_id, lambda body: body["status"] == "running")
    cancel = {"operation_type": "cancel-request", "payload": {"request_id": request_id}}
    answer = http.post(f"{CORTEX}/{job_id}/operation", json=cancel).json()
    assert answer["cancelled"] is True
    ended = poll(request_id, finished)
    assert ended["status"] == "cancelled"
    assert f"request {request_id} was cancelled" in ended["error"]
    # The job is untouched: the same sampler answers the next request.
    short = wire.dumps({"prompts": ["1+2="], "sampling_params": {"max_tokens": 3}})
    again = http.post(generate, content=short, headers=OCTET).json()["request_id"]
    assert poll(again, finished)["status"] == "done"
    assert service.get_job(job_id)["status"] == "running"
    late = http.post(f"{CORTEX}/{job_id}/operation", json=cancel).json()
    assert late["cancelled"] is False and late["status"] == "cancelled"


def test_the_slot_scheduler_serves_waiting_tenants_in_turn():
    slots = FairSlots(total=1)
    order: list[str] = []
    release = threading.Event()
    holding = []

    def hold(tenant: str) -> None:
        with slots.slot(tenant):
            order.append(tenant)
            release.wait()

    def take(tenant: str) -> None:
        with slots.slot(tenant):
            order.append(tenant)

    # Tenant a holds the slot; then a queues three more ops and b two.
    holding.append(threading.Thread(target=hold, args=("a",)))
    holding[-1].start()
    wait_until(
        lambda: slots.running() == 1,
        what="tenant a holding the slot",
        timeout_s=60,
        interval_s=0.01,
    )
    waiters = []
    for count, tenant in enumerate(("a", "a", "a", "b", "b"), start=1):
        waiters.append(threading.Thread(target=take, args=(tenant,)))
        waiters[-1].start()
        wait_until(
            lambda n=count: sum(slots.queued().values()) == n,
            what=f"{count} ops queued",
            timeout_s=60,
            interval_s=0.01,
        )
    release.set()
    for thread in holding + waiters:
        thread.join(timeout=60)
    # b's ops are not queued behind all of a's: the tenants alternate, b first (a just ran).
    assert order == ["a", "b", "a", "b", "a", "a"]


def test_one_tenant_never_holds_more_than_its_share_of_slots():
    slots = FairSlots(total=3, per_tenant=2)
    release = threading.Event()
    peak = []

    def hold(tenant: str) -> None:
        with slots.slot(tenant):
            peak.append(slots.running())
            release.wait()

    threads = [threading.Thread(target=hold, args=("a",)) for _ in range(4)]
    for thread in threads:
        thread.start()
    wait_until(
        lambda: slots.running() == 2 and slots.queued() == {"a": 2},
        what="tenant a running two ops and queueing two",
        timeout_s=60,
        interval_s=0.01,
    )
    other = threading.Thread(target=hold, args=("b",))
    other.start()
    # b gets the slot a may not take
    wait_until(
        lambda: slots.running() == 3, what="tenant b's op running", timeout_s=60, interval_s=0.01
    )
    release.set()
    for thread in [*threads, other]:
        thread.join(timeout=60)
    assert max(peak) <= 3


def test_another_tenant_is_served_while_one_tenant_runs_long_generates(tmp_path):
    # The starvation scenario: tenant a runs two long generates (two jobs), which on a server
    # without per-tenant shares would hold both op slots.
    service = Service(
        ServiceSettings(data_dir=tmp_path, device="cpu", max_concurrent_ops=2, max_ops_per_tenant=1)
    )
    try:
        a_jobs = [running(service, "a", "sampling") for _ in range(2)]
        b_job = running(service, "b", "log_probability")
        first = endless_generate(service, a_jobs[0], "a")
        sub = service.resolve(a_jobs[1], owner="a", kind="sampling")
        second = service.submit(sub, "generate", {"prompts": ["1"], "sampling_params": ENDLESS})
        quick = service.execute(b_job, "log-probs", {"prompts": ["1+2="]}, owner="b")
        assert quick["results"]
        # b's op finished while a's first generate still ran and its second still waited: the
        # bound on b's latency is one op of its own, not a's generations.
        assert not first.done() and not second.done()
        assert service.slots.queued() == {"a": 1}
    finally:
        service.close(drain_timeout=0)
    assert "drain-timeout" in ended_by(first, "op_cancelled")


def test_close_fails_busy_jobs_after_the_drain_timeout_and_stops_their_ops(tmp_path):
    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu"))
    busy = running(service, None, "sampling")
    idle = running(service, None, "training")
    future = endless_generate(service, busy, None)
    service.close(drain_timeout=0.2)
    message = ended_by(future, "op_cancelled")
    assert "--drain-timeout 0.2s" in message
    jobs = {j["job_id"]: j for j in service.list_jobs()}
    assert jobs[busy]["status"] == "failed" and "drain-timeout" in jobs[busy]["reason"]
    assert jobs[idle]["status"] == "terminated"


def test_a_server_with_several_tokens_keeps_a_slot_free_of_any_one_tenant():
    from arctic_platform.server.auth import TokenAuth
    from arctic_platform.server.serve import default_share

    assert default_share(2, TokenAuth([])) == 2  # one tenant: every slot
    assert default_share(2, TokenAuth(["a", "a"])) == 2
    assert default_share(2, TokenAuth(["a", "b"])) == 1
    assert default_share(4, TokenAuth(["a", "b", "c"])) == 3
    assert default_share(1, TokenAuth(["a", "b"])) == 1


def test_quick_operations_waiting_in_a_queue_hold_no_thread(tmp_path):
    """A Cortex quick operation answers inline, so its request waits while its op queues: it
    waited on one of the server's 40 worker threads, and a tenant queueing 60 behind its own
    long op took them all (another tenant's job listing then waited for that op). Now each
    waits on the event loop: all 60 are accepted while the queue is held, and Bob is served."""
    from arctic_platform.server.pending_work import OP_OVERHEAD_BYTES
    from tests.fake_engine import build_fake_engine
    from tests.server.test_hostile_uploads import ALICE, BOB, credentials

    service = Service(
        ServiceSettings(data_dir=tmp_path, device="cpu"), engine_builder=build_fake_engine
    )
    app = make_app(service, tokens=[ALICE, BOB])
    alice = app.state.auth.owner(f"Bearer {ALICE}")
    gate = threading.Event()
    job = service.create_job(job_request("training"), owner=alice)["job_id"]
    service.wait_until_running(job, owner=alice, timeout=60)
    sub = service.resolve(job, owner=alice, kind="training")
    service.executor.submit_runner(sub, "step", lambda: gate.wait(120))  # Alice's long op
    body = {"operation_type": "empty-training-cache", "sub_job_id": sub.sub_job_id}
    try:
        with serve_app(app) as url, httpx.Client(base_url=url, timeout=180) as http:

            def quick() -> httpx.Response:
                route = f"{CORTEX}/{job}/operation"
                return http.post(route, json=body, headers=credentials(ALICE))

            with ThreadPoolExecutor(60) as pool:
                answers = [pool.submit(quick) for _ in range(60)]
                wait_until(
                    lambda: service.pending.held(alice) >= 60 * OP_OVERHEAD_BYTES,
                    what="all 60 quick operations queued behind Alice's op",
                    timeout_s=60,
                )
                listed = http.get(CORTEX, headers=credentials(BOB))
                assert listed.status_code == 200 and listed.json()["jobs"] == []
                assert not any(a.done() for a in answers)
                gate.set()
                assert all(a.result().status_code == 200 for a in answers)
    finally:
        gate.set()
        service.close()
