"""The Service itself: job lifecycle, op routing, ordering, failures, persistence."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pytest
import torch

from arctic_platform.server.errors import BadRequest, Conflict, EngineFailure, NotFound
from arctic_platform.server.service import Service, ServiceSettings
from tests.server.conftest import job_request, sub_job
from tests.server.helpers import PROMPTS, SAMPLING, grpo_batch, same_weights, weights_of
from tests.waiting import wait_until


def grpo_step(service: Service, job_id: str, *, reference: bool = True) -> dict:
    """generate -> reward -> advantages -> fwd_no_grad -> fwd_bwd -> step -> weight sync."""
    out = service.execute(job_id, "generate", {"prompts": PROMPTS, "sampling_params": SAMPLING})
    tokenizer = service.resolve(job_id, owner=None, kind="sampling").engine.tokenizer
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    batch = grpo_batch(prompt_ids, out["results"], SAMPLING["n"])
    old = service.execute(job_id, "forward", {"batch": batch})
    batch["old_log_probs"] = old["batch"]["logprobs"]
    if reference:
        ref = service.execute(job_id, "forward", {"batch": batch, "reference_model": True})
        batch["ref_log_prob"] = ref["batch"]["logprobs"]
    train = service.execute(
        job_id,
        "forward-backward",
        {"batch": batch, "meta": {}, "processing": {"loss_fn": "verl_grpo"}},
    )
    step = service.execute(job_id, "step", {})
    sync = service.execute(
        job_id,
        "operation",
        {
            "operation_type": "weight-sync",
            "payload": {"target_sub_job_ids": [f"{job_id}:sampling:0"]},
        },
    )
    return {"train": train, "step": step, "sync": sync, "batch": batch, "old": old}


def test_lifecycle_and_sub_job_ids(service):
    info = service.create_job(job_request(), owner=None)
    assert info["status"] in ("pending", "initializing")
    job_id = info["job_id"]
    assert [s["sub_job_id"] for s in info["sub_jobs"]] == [
        f"{job_id}:training:0",
        f"{job_id}:sampling:0",
        f"{job_id}:log_prob:0",
    ]
    assert [s["job_type"] for s in info["sub_jobs"]] == ["training", "sampling", "log_probability"]
    running = service.wait_until_running(job_id, timeout=120)
    assert running["status"] == "running"
    assert all(s["status"] == "running" for s in running["sub_jobs"])
    assert service.cancel_job(job_id)["status"] == "cancelled"
    assert service.cancel_job(job_id)["status"] == "cancelled"  # idempotent
    with pytest.raises(Conflict, match="cancelled"):
        service.execute(job_id, "step", {})


def test_a_grpo_step_changes_the_sampler_only_after_weight_sync(service, running_job):
    trainer = service.resolve(running_job, owner=None, kind="training").engine
    sampler = service.resolve(running_job, owner=None, kind="sampling").engine
    before = weights_of(sampler)
    result = grpo_step(service, running_job)
    assert set(result["train"]) == {"job_id", "avg_loss", "loss", "metrics"}
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "loss"} <= set(
        result["train"]["metrics"]
    )
    assert result["step"]["global_steps"] == 1 and result["step"]["grad_norm"] > 0
    assert result["sync"]["status"] == "ok"
    after = weights_of(sampler)
    assert not same_weights(before, after)
    assert same_weights(after, weights_of(trainer))
    # Old log-probs are position-indexed [B, S] and usable as old_log_probs directly.
    assert result["old"]["batch"]["logprobs"].shape == result["batch"]["input_ids"].shape


def test_ops_on_one_job_run_in_arrival_order(service, running_job):
    batch = grpo_step(service, running_job)["batch"]
    body = {"batch": batch, "meta": {}, "processing": {}}
    training = service.resolve(running_job, owner=None, kind="training")
    futures = []
    for _ in range(3):
        futures.append(service.submit(training, "forward-backward", body))
        futures.append(service.submit(training, "step", {}))
    steps = [f.result()["global_steps"] for f in futures[1::2]]
    assert steps == [2, 3, 4]


def test_two_jobs_run_concurrently(service):
    ids = []
    for _ in range(2):
        info = service.create_job(job_request("training", "sampling"))
        ids.append(info["job_id"])
    for job_id in ids:
        service.wait_until_running(job_id, timeout=120)
    errors, results = [], {}

    def run(job_id):
        try:
            results[job_id] = grpo_step(service, job_id, reference=False)["step"]["global_steps"]
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(j,)) for j in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == {ids[0]: 1, ids[1]: 1}


def test_bad_bodies_fail_the_request_only_and_change_nothing(service, running_job):
    trainer = service.resolve(running_job, owner=None, kind="training").engine
    before = weights_of(trainer)
    cases = [
        ("step", {"learning_rat": 0.1}, "learning_rat"),
        ("step", {"learning_rate": -1}, "learning_rate"),
        (
            "forward-backward",
            {"batch": {"input_ids": torch.ones(1, 3, dtype=torch.long)}},
            "attention_mask",
        ),
        ("forward-backward", {"tensors": {}}, "needs 'batch'"),
        ("generate", {"prompts": []}, "prompts"),
        ("generate", {"prompts": ["x"], "sampling_params": {"temperatur": 1}}, "temperatur"),
        ("operation", {"operation_type": "explode"}, "unknown operation_type 'explode'"),
        ("save", {"checkpoint_type": "everything"}, "checkpoint_type"),
    ]
    for op, body, message in cases:
        with pytest.raises(BadRequest, match=message):
            service.execute(running_job, op, body)
    assert same_weights(before, weights_of(trainer))
    assert service.get_job(running_job)["status"] == "running"
    assert service.execute(running_job, "step", {})["global_steps"] == 1


def test_wrong_job_type_and_unknown_ids(service, running_job):
    with pytest.raises(BadRequest, match="does not run on a sampling sub-job"):
        service.execute(f"{running_job}:sampling:0", "step", {})
    with pytest.raises(NotFound, match="not found"):
        service.execute("nosuchjob", "step", {})
    with pytest.raises(NotFound, match="sub-job"):
        service.execute(f"{running_job}:training:7", "step", {})
    info = service.create_job(job_request("sampling"))
    service.wait_until_running(info["job_id"], timeout=120)
    with pytest.raises(BadRequest, match="no training sub-job"):
        service.execute(info["job_id"], "step", {})


def test_initialization_failure_keeps_the_reason_and_the_server_alive(service):
    empty = service.paths.tenant_root(None) / "not-a-model"
    empty.mkdir()
    info = service.create_job({"sub_job_configs": [sub_job("training", model_name=str(empty))]})
    with pytest.raises(Conflict, match="initialization failed"):
        service.wait_until_running(info["job_id"], timeout=120)
    failed = service.get_job(info["job_id"])
    assert failed["status"] == "failed" and "initialization failed" in failed["reason"]
    ok = service.create_job(job_request("training"))
    assert service.wait_until_running(ok["job_id"], timeout=120)["status"] == "running"


def test_an_engine_failure_marks_the_job_failed_with_its_reason(service, running_job):
    sampler = service.resolve(running_job, owner=None, kind="sampling")

    # Break the engine for real: a model whose forward raises what torch raises for a device
    # fault (after which the device's context is lost: the job cannot go on, whatever the op).
    def explode(*args, **kwargs):
        raise torch.AcceleratorError("CUDA error: device-side assert (simulated hardware fault)")

    sampler.engine.model.forward = explode
    with pytest.raises(EngineFailure, match="device-side assert"):
        service.execute(
            running_job, "generate", {"prompts": ["1"], "sampling_params": {"max_tokens": 2}}
        )
    info = service.get_job(running_job)
    assert info["status"] == "failed" and "device-side assert" in info["reason"]
    with pytest.raises(Conflict, match="failed"):
        service.execute(running_job, "step", {})
    other = service.create_job(job_request("training"))
    assert service.wait_until_running(other["job_id"], timeout=120)["status"] == "running"


def test_create_job_validation_names_the_field(service):
    with pytest.raises(BadRequest, match="sub_job_configs: List should have at least 1 item"):
        service.create_job({"sub_job_configs": []})
    with pytest.raises(BadRequest, match="training_config: .*unknown field 'optimzer'"):
        service.create_job(
            {"sub_job_configs": [sub_job("training", training_config={"optimzer": {}})]}
        )
    with pytest.raises(BadRequest, match="job_type"):
        service.create_job({"sub_job_configs": [sub_job("trainer")]})
    with pytest.raises(NotFound, match="source_checkpoint_info"):
        service.create_job(
            {
                "sub_job_configs": [
                    sub_job("training", source_checkpoint_info={"checkpoint_id": "x"})
                ]
            }
        )
    assert service.list_jobs() == []


def test_cortex_passthrough_keys_are_accepted_and_reported(service):
    spec = sub_job(
        "sampling",
        inference_config={
            "gpu_memory_utilization": 0.3,
            "vllm_config": {"enforce_eager": True, "max_num_seqs": 8},
            "peft_config": {"peft_type": "Lora", "r": 8},
        },
    )
    info = service.create_job({"sub_job_configs": [spec]})
    assert info["sub_jobs"][0]["ignored_settings"] == {
        "gpu_memory_utilization": 0.3,
        "peft_config": {"peft_type": "Lora", "r": 8},
        "vllm_config.enforce_eager": True,
    }


def test_restart_lists_checkpoints_and_starts_a_job_from_one(tmp_path):
    settings = ServiceSettings(data_dir=tmp_path / "data", device="cpu")
    first = Service(settings)
    info = first.create_job(job_request("training", "sampling"))
    job_id = info["job_id"]
    first.wait_until_running(job_id, timeout=120)
    grpo_step(first, job_id, reference=False)
    saved = first.execute(job_id, "save", {"export_hf": True})
    trained = weights_of(first.resolve(job_id, owner=None, kind="training").engine)
    first.close()

    second = Service(settings)
    try:
        assert second.get_job(job_id)["status"] == "terminated"
        assert [c["checkpoint_id"] for c in second.list_checkpoints(job_id)] == [
            saved["checkpoint_id"]
        ]
        source = {"checkpoint_id": saved["checkpoint_id"], "source_job_id": job_id}
        new = second.create_job(
            {
                "sub_job_configs": [
                    sub_job("training", source_checkpoint_info=source),
                    sub_job("sampling", source_checkpoint_info=source),
                ]
            }
        )
        second.wait_until_running(new["job_id"], timeout=120)
        trainer = second.resolve(new["job_id"], owner=None, kind="training").engine
        sampler = second.resolve(new["job_id"], owner=None, kind="sampling").engine
        assert trainer.global_steps == 1
        assert same_weights(trained, weights_of(trainer))
        assert same_weights(trained, weights_of(sampler))
        with pytest.raises(Conflict, match="terminated"):
            second.execute(job_id, "step", {})
    finally:
        second.close()


def test_owners_only_see_their_jobs(service):
    mine = service.create_job(job_request("training"), owner="alice")
    assert [j["job_id"] for j in service.list_jobs(owner="alice")] == [mine["job_id"]]
    assert service.list_jobs(owner="bob") == []
    with pytest.raises(NotFound):
        service.get_job(mine["job_id"], owner="bob")
    with pytest.raises(NotFound):
        service.execute(mine["job_id"], "step", {}, owner="bob")


def test_a_half_applied_weight_load_is_a_conflict_until_a_full_sync(service, running_job):
    from arctic_platform.engine.weights import (
        WeightLoadError,
        iter_weights_from_chunks,
        stream_weights,
    )

    trainer = service.resolve(running_job, owner=None, kind="training").engine
    sampler = service.resolve(running_job, owner=None, kind="sampling").engine
    chunks = list(stream_weights(trainer.model, chunk_bytes=200_000))
    del chunks[-1]  # the stream ends early: some tensors were written, some not
    with pytest.raises(WeightLoadError):
        sampler.load_weights(iter_weights_from_chunks(chunks))
    body = {"prompts": ["1+1="], "sampling_params": {"max_tokens": 2}}
    with pytest.raises(Conflict, match="weights") as err:
        service.execute(running_job, "generate", body)
    assert err.value.code == "weights_incomplete"
    assert service.get_job(running_job)["status"] == "running"
    service.execute(
        running_job,
        "operation",
        {
            "operation_type": "weight-sync",
            "payload": {"target_sub_job_ids": [f"{running_job}:sampling:0"]},
        },
    )
    assert len(service.execute(running_job, "generate", body)["results"]) == 1


def test_a_restarted_server_removes_staging_folders_of_killed_saves(tmp_path):
    data = tmp_path / "data"
    first = Service(ServiceSettings(data_dir=data, device="cpu"))
    job_id = first.create_job(job_request("training"))["job_id"]
    first.wait_until_running(job_id, timeout=120)
    space = first.paths.tenant_root(None)
    custom = space / first.execute(job_id, "save", {"path": "custom"})["path"]
    default = space / first.execute(job_id, "save", {"step": 1})["path"]
    first.close()
    stale = [
        custom.parent / ".tmp-checkpoint-2-0123",
        default.parent / ".old-checkpoint-1-99",
    ]
    for folder in stale:
        (folder / "model.safetensors").parent.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    kept = default.parent / "notes"
    kept.mkdir()
    second = Service(ServiceSettings(data_dir=data, device="cpu"))
    try:
        assert not any(folder.exists() for folder in stale)
        assert kept.is_dir() and custom.is_dir() and default.is_dir()
    finally:
        second.close()


def test_a_job_whose_model_load_hangs_does_not_delay_other_jobs(service):
    # A model folder whose config.json is a FIFO: reading it blocks until someone writes, a real
    # hang in the model load (like a stalled network filesystem).
    stuck = service.paths.tenant_root(None) / "stalled-model"
    stuck.mkdir()
    os.mkfifo(stuck / "config.json")
    hung = service.create_job({"sub_job_configs": [sub_job("sampling", model_name=str(stuck))]})
    try:
        ok = service.create_job(job_request("training", "sampling"))
        assert service.wait_until_running(ok["job_id"], timeout=120)["status"] == "running"
        assert service.get_job(hung["job_id"])["status"] == "initializing"
    finally:
        release(stuck / "config.json", until=lambda: service.get_job(hung["job_id"])["status"])
    with pytest.raises(Conflict, match="initialization failed"):
        service.wait_until_running(hung["job_id"], timeout=120)


def release(fifo: Path, *, until) -> None:
    """Feed a FIFO's readers junk until ``until()`` reports the stuck job failed."""

    def fed() -> bool:
        if until() == "failed":
            return True
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader at this moment
            return False
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(fd, b"not json")
        os.close(fd)
        return False

    wait_until(fed, what="the stuck job failing", interval_s=0.05)


def test_concurrently_built_engines_start_from_the_same_weights_as_alone(service):
    spec = {
        "sub_job_configs": [
            sub_job(
                "training",
                training_config={
                    "optimizer": {"name": "AdamW", "lr": 1e-3},
                    "peft_config": {"peft_type": "LORA", "r": 4, "alpha": 8},
                },
            )
        ]
    }
    ids = [service.create_job(spec)["job_id"] for _ in range(3)]
    engines = [
        service.resolve(
            service.wait_until_running(i, timeout=120)["job_id"], owner=None, kind="training"
        ).engine
        for i in ids
    ]
    first = weights_of(engines[0])
    assert all(same_weights(first, weights_of(e)) for e in engines[1:])
