"""A tenant's history of ended jobs is bounded.

A job that fails at once (a model folder that holds no model) can be created in a loop: without
a bound each stayed in the server's memory and store for good, and every job creation scanned
them all. Past ``MAX_ENDED_JOBS_PER_TENANT`` ended jobs (2 here) a tenant's oldest ones are
forgotten (a 404 like an unknown id, gone from the list and from the store, so a restart does
not bring them back); a job whose checkpoints are catalogued is kept besides them, and other
tenants' are not touched. Real Service, real ``builtin:tiny`` engine for the job that saves.
"""

from __future__ import annotations

import pytest

from arctic_platform.server import job_registry
from arctic_platform.server.app import create_app
from arctic_platform.server.errors import BadRequest, NotFound
from arctic_platform.server.job_builder import MAX_JOB_CONFIG_BYTES
from arctic_platform.server.service import Service, ServiceSettings
from tests.server.conftest import job_request
from tests.waiting import wait_until


def test_a_tenants_oldest_ended_jobs_past_the_history_are_forgotten(tmp_path, monkeypatch):
    monkeypatch.setattr(job_registry, "MAX_ENDED_JOBS_PER_TENANT", 2)
    settings = ServiceSettings(data_dir=tmp_path / "data", device="cpu")
    service = Service(settings)

    def failing(owner: str) -> str:
        (service.paths.tenant_root(owner) / "not-a-model").mkdir(parents=True, exist_ok=True)
        spec = {"job_type": "training", "model_name": "not-a-model"}
        job_id = service.create_job({"sub_job_configs": [spec]}, owner=owner)["job_id"]
        wait_until(
            lambda: service.job_status(job_id, owner=owner) == "failed", what="the job failed"
        )
        return job_id

    try:
        saved = service.create_job(job_request("training"), owner="alice")["job_id"]
        service.wait_until_running(saved, owner="alice", timeout=120)
        service.execute(saved, "save", {}, owner="alice")
        service.cancel_job(saved, owner="alice")
        bobs = failing("bob")
        first_id = failing("alice")
        first = service.jobs.find(first_id)
        jobs = [first_id] + [failing("alice") for _ in range(4)]  # the fifth's drops two
        for gone in jobs[:2]:
            with pytest.raises(NotFound):
                service.get_job(gone, owner="alice")
        # A late state change of a dropped job (a build finishing after a cancel) does not
        # write its row back.
        service.jobs.set_status(first, "cancelled", "a late change")
        assert [service.job_status(j, owner="alice") for j in jobs[2:]] == ["failed"] * 3
        assert service.job_status(saved, owner="alice") == "cancelled"
        assert service.list_checkpoints(saved, owner="alice")
        assert service.job_status(bobs, owner="bob") == "failed"
        listed = {job["job_id"] for job in service.list_jobs(owner="alice")}
        assert listed == {saved, *jobs[2:]}
        # A Tinker run whose job was forgotten lists no checkpoints (it had none), not a 404.
        tinker = create_app(service).state.tinker.checkpoints
        tinker.record_run("s:train:0", owner="alice", job_id=jobs[0], base_model="m", rank=4)
        assert tinker.list("s:train:0", "alice") == []
    finally:
        service.close()
    restarted = Service(settings)
    try:
        listed = {job["job_id"] for job in restarted.list_jobs(owner="alice")}
        assert listed == {saved, *jobs[2:]}
    finally:
        restarted.close()


@pytest.mark.parametrize("where", ["experiment_name", "free-form ds_config"])
def test_a_job_configuration_beyond_a_mib_is_refused_before_it_is_kept(tmp_path, where):
    """A job's configuration is kept as long as the job is listed (ended jobs included): 20 jobs
    failing at once with 8 MiB names each grew the server by 255 MB and its store by 336 MB, so a
    configuration beyond ``MAX_JOB_CONFIG_BYTES`` is a 400 saying so, and nothing is kept."""
    service = Service(ServiceSettings(data_dir=tmp_path, device="cpu"))
    big = "x" * (MAX_JOB_CONFIG_BYTES + 1)
    request = job_request("training")
    if where == "experiment_name":
        request["experiment_name"] = big
    else:  # DeepSpeed's config travels as is (reported in ignored_settings where unused)
        request["sub_job_configs"][0]["training_config"] = {"ds_config": {"junk": big}}
    try:
        with pytest.raises(BadRequest, match="configuration is .* bytes as stored"):
            service.create_job(request)
        assert service.list_jobs() == []
        service.create_job(job_request("training") | {"experiment_name": "e" * 1000})
    finally:
        service.close()
