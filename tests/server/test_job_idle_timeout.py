"""``serve --job-idle-timeout``: a job whose driver went away without closing its client is
cancelled once no op was submitted or running for the timeout, its engines released; busy and
used jobs stay, and status reads do not keep a job alive."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from arctic_platform import cli
from arctic_platform.client import create_arctic_rl_client
from arctic_platform.client.errors import ConflictError
from arctic_platform.server.service import Service, ServiceSettings
from tests.fake_engine import build_fake_engine
from tests.live_server import serve_app, serve_process
from tests.server.conftest import CORTEX, TINY, job_request, make_app
from tests.waiting import wait_until

# Far beyond any test's duration: the background reaper never acts; the tests call reap().
LONG_S = 3600.0


@pytest.fixture(scope="module")
def idle_service(tmp_path_factory):
    """The idle expiry's subject is the jobs' use, not their engines: FakeEngine serves them."""
    svc = Service(
        ServiceSettings(
            data_dir=tmp_path_factory.mktemp("idle") / "data",
            device="cpu",
            job_idle_timeout_s=LONG_S,
        ),
        engine_builder=build_fake_engine,
    )
    yield svc
    svc.close()


def start(service: Service, *kinds: str) -> str:
    job_id = service.create_job(job_request(*kinds))["job_id"]
    service.wait_until_running(job_id, timeout=120)
    return job_id


def later(seconds: float) -> float:
    """A reaper's ``now`` that many seconds after this moment."""
    return time.time() + seconds


def test_a_driver_that_exits_without_close_has_its_job_expired(tmp_path):
    """The observed case, end to end: ``serve --job-idle-timeout 1``, a driver creates a job
    and goes away without ``close()``; the server cancels the job, frees its engines, and says
    why in ``jobs show``, ``jobs logs`` and to a client that calls it later."""
    with serve_process(tmp_path / "data", "--job-idle-timeout", "1") as (_, url):
        backend = {"type": "http", "url": url}
        config = {"model": TINY, "seed": 0, "backend": backend, "sampling": {}, "training": None}
        driver = create_arctic_rl_client(config, blocking_calls=True)
        driver.generate(["1+2="], {"max_tokens": 2})
        reconnect = driver.reconnect_config()
        job_id = reconnect.sampling_job_id.split(":", 1)[0]
        # the driver dies here: no close(), no shutdown()
        wait_until(
            lambda: not httpx.get(url + CORTEX + "/capacity", timeout=30).json()["active_sub_jobs"],
            what="the idle job kept its engine",
            timeout_s=60,
            interval_s=0.1,
        )
        shown = CliRunner().invoke(cli.app, ["jobs", "show", job_id, "--url", url, "--json"])
        assert shown.exit_code == 0, shown.output
        job = json.loads(shown.stdout)
        assert job["status"] == "cancelled"
        assert job["reason"].startswith("expired after 1 s idle")
        logs = CliRunner().invoke(cli.app, ["jobs", "logs", job_id, "--url", url])
        assert "status cancelled: expired after 1 s idle" in logs.stdout
        # The driver's client, used again later, and a new client reconnecting to the job are
        # told it expired (not that it does not exist).
        with pytest.raises(ConflictError, match="expired after 1 s idle"):
            driver.generate(["1+2="], {"max_tokens": 2})
        with pytest.raises(ConflictError, match="is cancelled: expired after 1 s idle"):
            create_arctic_rl_client(reconnect, blocking_calls=True)
        driver.close()  # idempotent on the expired job


def test_an_idle_job_is_cancelled_and_its_engines_released(idle_service):
    job_id = start(idle_service, "training", "sampling")
    # operator and owner reads do not count as use
    idle_service.get_job(job_id)
    idle_service.list_jobs()
    idle_service.tail_logs(job_id)
    assert job_id not in idle_service.expire_idle_jobs(cutoff=time.time() - 60)
    assert job_id in idle_service.idle_reaper.reap(now=later(LONG_S + 1))
    job = idle_service.jobs.get(job_id, None)
    assert job.status == "cancelled" and all(s.engine is None for s in job.sub_jobs)
    assert [s.status for s in job.sub_jobs] == ["cancelled", "cancelled"]
    # expired once: a later sweep or the owner's cancel leave it as it is
    assert job_id not in idle_service.idle_reaper.reap(now=later(LONG_S + 1))
    assert idle_service.cancel_job(job_id)["reason"].startswith(f"expired after {LONG_S:g} s")


def test_a_job_with_an_op_running_or_queued_is_not_expired(idle_service):
    job_id = start(idle_service, "training")
    sub = idle_service.resolve(job_id, owner=None, kind="training")
    release = threading.Event()
    running = idle_service.executor.submit_runner(sub, "held", lambda: release.wait(60))
    queued = idle_service.submit(sub, "step", {})
    try:
        assert job_id not in idle_service.idle_reaper.reap(now=later(10 * LONG_S))
    finally:
        release.set()
    assert running.result(timeout=60) is True and "global_steps" in queued.result(timeout=60)
    wait_until(
        lambda: not idle_service.busy(), what="the ops ending", timeout_s=30, interval_s=0.01
    )
    # the idle clock started when the last op ended
    assert job_id not in idle_service.idle_reaper.reap(now=later(LONG_S - 60))
    assert job_id in idle_service.idle_reaper.reap(now=later(LONG_S + 1))


def test_a_job_used_periodically_stays(idle_service):
    job_id = start(idle_service, "sampling")
    for _ in range(3):
        before = time.time()
        idle_service.execute(job_id, "generate", {"prompts": ["1+2="], "sampling_params": {}})
        # each op restarts the clock: just short of the timeout after it, the job stays
        assert job_id not in idle_service.idle_reaper.reap(now=before + LONG_S - 1)
    assert idle_service.get_job(job_id)["status"] == "running"
    idle_service.cancel_job(job_id)


def test_a_weight_sync_into_another_job_is_use_of_that_job(idle_service, monkeypatch):
    """Clients keep their sampler in its own job; a training phase longer than the timeout
    syncs into it. The sync is an op on the sampler's job: busy while it runs, then used."""
    trainer, sampler = start(idle_service, "training"), start(idle_service, "sampling")
    syncing, release = threading.Event(), threading.Event()
    engine = idle_service.resolve(trainer, owner=None, kind="training").engine
    original = engine.sync_weights_to

    def held_sync(target):
        syncing.set()
        release.wait(60)
        return original(target)

    monkeypatch.setattr(engine, "sync_weights_to", held_sync)
    body = {"target_sub_job_ids": [f"{sampler}:sampling:0"]}
    results: list = []
    sync = threading.Thread(
        target=lambda: results.append(
            idle_service.execute(f"{trainer}:training:0", "weight-sync", body)
        )
    )
    sync.start()
    try:
        assert syncing.wait(60)
        assert sampler not in idle_service.idle_reaper.reap(now=later(10 * LONG_S))
    finally:
        release.set()
        sync.join(60)
    assert results[0]["targets"][0]["sub_job_id"] == f"{sampler}:sampling:0"
    # the sync restarted the sampler job's clock, as an op of its own does
    assert sampler not in idle_service.idle_reaper.reap(now=later(LONG_S - 60))
    assert idle_service.get_job(sampler)["status"] == "running"
    for job_id in (trainer, sampler):
        idle_service.cancel_job(job_id)


def test_collecting_an_op_over_the_cortex_api_is_use_reading_the_job_is_not(idle_service):
    """A Cortex client's poll of its op's request restarts the clock; its status read does not."""
    job_id = start(idle_service, "training")
    with serve_app(make_app(idle_service)) as url, httpx.Client(base_url=url, timeout=60) as http:
        request_id = http.post(f"{CORTEX}/{job_id}/step", json={}).json()["request_id"]
        deadline = time.monotonic() + 60  # one bound for the request and the op's end
        wait_until(
            lambda: http.get(f"{CORTEX}/{job_id}/requests/{request_id}").json()["status"] == "done",
            what=f"request {request_id} done",
            timeout_s=60,
        )
        wait_until(
            lambda: not idle_service.busy(),
            what="the op ending",
            timeout_s=deadline - time.monotonic(),
            interval_s=0.01,
        )
        polled_at = time.time()
        assert http.get(f"{CORTEX}/{job_id}/requests/{request_id}").status_code == 200
        assert job_id not in idle_service.idle_reaper.reap(now=polled_at + LONG_S)
        read_at = time.time()
        assert http.get(f"{CORTEX}/{job_id}").json()["status"] == "running"
        assert job_id in idle_service.idle_reaper.reap(now=read_at + LONG_S + 1)
        assert http.get(f"{CORTEX}/{job_id}").json()["reason"].startswith("expired after")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_serve_refuses_a_bad_job_idle_timeout_naming_the_flag(value):
    result = CliRunner().invoke(cli.app, ["serve", "--job-idle-timeout", value])
    assert result.exit_code == 2
    assert "--job-idle-timeout" in result.output


def test_no_idle_timeout_by_default(tmp_path):
    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu"))
    try:
        assert service.settings.job_idle_timeout_s is None and service.idle_reaper is None
    finally:
        service.close()
    with pytest.raises(ValueError, match="job idle timeout: must be > 0"):
        Service(ServiceSettings(data_dir=tmp_path, device="cpu", job_idle_timeout_s=0))
