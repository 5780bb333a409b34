"""The on-prem HTTP API over a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import torch

from arctic_platform import wire
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app
from tests.server.conftest import OCTET, TINY, make_app
from tests.server.helpers import PROMPTS, SAMPLING, grpo_batch, same_weights, weights_of


def post_frame(http, path: str, body) -> object:
    response = http.post(path, content=wire.dumps(body), headers=OCTET)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    return wire.loads(response.content, tensor_type="torch")


def initialize(http, job_type: str, **extra) -> str:
    body = {"model_name": TINY, "job_type": job_type, "seed": 0, **extra}
    response = http.post("/initialize", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["running"] is True
    return response.json()["job_id"]


def test_health_and_a_whole_grpo_step(http, service):
    health = http.get("/health").json()
    assert health["status"] == "OK" and health["server"] == "arctic-platform" and health["instance"]
    training = initialize(
        http, "training", training_config={"optimizer": {"lr": 1e-3}}, ds_config={"zero": 3}
    )
    sampling = initialize(http, "sampling", vllm_config={"max_num_seqs": 16})
    log_prob = initialize(http, "log_prob")
    assert http.get(f"/job/{training}").json()["status"] == "RUNNING"
    assert set(http.get("/status").json()["jobs"]) == {training, sampling, log_prob}

    generated = post_frame(
        http, f"/generate?job_id={sampling}", {"prompts": PROMPTS, "sampling_params": SAMPLING}
    )["results"]
    assert len(generated) == len(PROMPTS) * SAMPLING["n"]
    tokenizer = service.resolve(sampling, owner=None).engine.tokenizer
    batch = grpo_batch([tokenizer(p)["input_ids"] for p in PROMPTS], generated, SAMPLING["n"])
    old = post_frame(http, f"/forward?job_id={training}", {"batch": batch})["batch"]["logprobs"]
    ref = post_frame(http, f"/forward?job_id={log_prob}", {"batch": batch})["batch"]["logprobs"]
    assert torch.equal(old, ref)  # same initial weights, same scoring code
    batch |= {"old_log_probs": old, "ref_log_prob": ref}
    meta = {"actor_config": {"use_kl_loss": True, "kl_loss_coef": 0.01, "kl_loss_type": "k3"}}
    train = post_frame(
        http,
        f"/forward-backward?job_id={training}",
        {"batch": batch, "meta": meta, "processing": {"loss_fn": "verl_grpo"}},
    )
    assert {"job_id", "avg_loss", "loss", "metrics"} == set(train)
    assert {"actor/pg_loss", "kl_loss", "kl_coef", "loss"} <= set(train["metrics"])
    step = http.post(f"/step?job_id={training}", json={}).json()
    assert step["global_steps"] == 1 and step["metrics"]["grad_norm"] == step["grad_norm"]

    sampler = service.resolve(sampling, owner=None).engine
    before = weights_of(sampler)
    sync = http.post(
        f"/operation?job_id={training}",
        json={
            "operation_type": "weight-sync",
            "sub_job_id": training,
            "sub_job_type": "training",
            "payload": {"source_sub_job_id": training, "target_sub_job_ids": [sampling]},
        },
    ).json()
    assert sync["status"] == "ok"
    assert not same_weights(before, weights_of(sampler))

    saved = http.post(f"/save?job_id={training}", json={"export_hf": False}).json()
    assert saved["global_step"] == 1 and saved["path"].endswith("checkpoint-1")
    http.post(f"/step?job_id={training}", json={})  # no gradients: weights unchanged, step 2
    loaded = http.post(f"/load-checkpoint?job_id={training}", json={"path": None, "step": 1}).json()
    assert loaded["global_step"] == 1

    for op, body in [
        ("sleep-inference", {"level": 1}),
        ("wake-inference", ["weights", "kv_cache"]),
        ("reset-prefix-cache", {"drain": True, "timeout_s": 60.0, "retry_interval_s": 0.1}),
    ]:
        assert http.post(f"/{op}?job_id={sampling}", json=body).status_code == 200
    for op in ("sleep-training", "wake-training", "empty-training-cache"):
        result = http.post(f"/{op}?job_id={training}", json={}).json()
        assert result["workers"][0]["reason"]  # CPU: says honestly why nothing moved
    log_probs = post_frame(
        http, f"/log-probs?job_id={log_prob}", {"prompts": ["ab"], "completions": ["cd"]}
    )
    assert len(log_probs["results"][0]["logprobs"]) == 2
    assert http.post(
        "/destroy", params={"job_id": training}, json={"job_type": "training"}
    ).json() == {"job_id": training}
    assert http.get(f"/job/{training}").json()["status"] == "CANCELLED"


def test_errors_name_the_problem_and_leave_state_alone(http, service):
    training = initialize(http, "training", training_config={"optimizer": {"lr": 1e-3}})
    sampling = initialize(http, "sampling")
    before = weights_of(service.resolve(training, owner=None).engine)
    cases = [
        (http.post("/step?job_id=nosuchjob", json={}), 404, "not found"),
        (
            http.post(f"/generate?job_id={training}", json={"prompts": ["x"]}),
            400,
            "does not run on a training",
        ),
        (http.post(f"/step?job_id={sampling}", json={}), 400, "wrong_job_type"),
        (
            http.post(
                f"/forward-backward?job_id={training}", content=b"\x80\x04junk", headers=OCTET
            ),
            400,
            "legacy pickle",
        ),
        (
            http.post(f"/forward-backward?job_id={training}", content=b"garbage!", headers=OCTET),
            400,
            "malformed DSSST1",
        ),
        (
            http.post(
                f"/step?job_id={training}",
                content=b"{not json",
                headers={"content-type": "application/json"},
            ),
            400,
            "malformed JSON",
        ),
        (http.post(f"/step?job_id={training}", json={"lr": 1}), 400, "lr: Extra inputs"),
        (http.post("/step", json={}), 400, "job_id: Field required"),
        (http.post(f"/explode?job_id={training}", json={}), 404, "unknown op"),
        (
            http.post("/initialize", json={"model_name": TINY, "job_type": "trainer"}),
            400,
            "job_type",
        ),
        (
            http.post(
                f"/forward-backward?job_id={training}",
                content=wire.dumps({"batch": {"input_ids": np.ones((2, 3), np.int64)}}),
                headers=OCTET,
            ),
            400,
            "attention_mask",
        ),
    ]
    for response, status, text in cases:
        assert response.status_code == status, response.text
        assert text in response.text
        assert "message" in response.json()
    assert same_weights(before, weights_of(service.resolve(training, owner=None).engine))
    assert http.post(f"/step?job_id={training}", json={}).json()["global_steps"] == 1


def test_generate_answers_logprobs_in_vllms_shape(http, service):
    sampling = initialize(http, "sampling")
    params = {"max_tokens": 4, "logprobs": 2, "seed": 3, "temperature": 1.0}
    (result,) = post_frame(
        http, f"/generate?job_id={sampling}", {"prompts": ["1+2="], "sampling_params": params}
    )["results"]
    tokenizer = service.resolve(sampling, owner=None).engine.tokenizer
    assert len(result["logprobs"]) == len(result["token_ids"]) == 4
    for token, position in zip(result["token_ids"], result["logprobs"], strict=True):
        assert str(token) in position and len(position) in (2, 3)  # top-2 plus the sampled one
        ranks = sorted(entry["rank"] for entry in position.values())
        assert ranks[:2] == [1, 2]
        for key, entry in position.items():
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert entry["decoded_token"] == tokenizer.decode([int(key)])
            assert entry["logprob"] <= 0


REFERENCE_TRAINING_INIT = {  # what the reference client's /initialize sends for a training job
    "model_name": TINY,
    "job_type": "training",
    "arctic_inference_config": None,
    "full_determinism": False,
    "seed": 42,
    "ds_config": {
        "train_batch_size": 8,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"warmup_num_steps": 2, "total_num_steps": 20, "cos_min_ratio": 0.1},
        },
    },
    "training_config": None,
    "ds_worker_config": {
        "use_liger": True,
        "attn_implementation": "eager",
        "logits_optimization": "memory",  # SkyRL's default chunked-logits knobs
        "logits_optimization_peak_mem_size_in_gib": 4.0,
    },
    "checkpoint_path": "runs/reference",  # relative: inside the caller's space
    "cuda_ipc": False,
    "low_memory": False,
}


def test_initialize_honours_the_reference_ds_config_and_reports_the_rest(http, service):
    """ds_config is honoured, and checkpoint_path is where saves and loads without path go."""
    response = http.post("/initialize", json=REFERENCE_TRAINING_INIT)
    assert response.status_code == 200, response.text
    answer = response.json()
    trainer = service.resolve(answer["job_id"], owner=None).engine
    config = trainer.config
    assert (config.optimizer.lr, config.optimizer.betas) == (1e-3, (0.8, 0.95))
    assert (config.optimizer.eps, config.optimizer.weight_decay) == (1e-6, 0.1)
    assert config.optimizer.grad_clip == 0.5
    assert (config.scheduler.name, config.scheduler.warmup_steps) == ("cosine", 2)
    assert (config.scheduler.total_steps, config.scheduler.min_lr_ratio) == (20, 0.1)
    assert config.model.attn_implementation == "eager"
    assert (config.logits.optimization, config.logits.peak_mem_size_in_gib) == ("memory", 4.0)
    assert trainer._head.budget_bytes == 4 * 2**30
    assert trainer.optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    assert set(answer["ignored_settings"]) == {
        "ds_config.bf16",
        "ds_config.zero_optimization",
        "ds_worker_config.use_liger",
        "full_determinism",
        "cuda_ipc",
        "low_memory",
    }
    root = service.paths.tenant_root(None) / "runs" / "reference"
    assert Path(config.checkpoint_dir) == root.resolve()
    job_id = answer["job_id"]
    saved = http.post(f"/save?job_id={job_id}", json={})
    assert saved.status_code == 200, saved.text
    folder = service.paths.tenant_root(None) / saved.json()["path"]  # named in the caller's space
    assert folder.is_relative_to(root) and folder.is_dir()
    loaded = http.post(f"/load-checkpoint?job_id={job_id}", json={})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["path"] == saved.json()["path"]


def test_initialize_refuses_a_checkpoint_path_outside_the_callers_space(http, service, tmp_path):
    body = {**REFERENCE_TRAINING_INIT, "checkpoint_path": str(tmp_path / "elsewhere")}
    response = http.post("/initialize", json=body)
    assert response.status_code == 400 and "checkpoint_path" in response.text
    assert http.get("/status").json()["jobs"] == {}
    assert not (tmp_path / "elsewhere").exists()


def test_a_checkpoint_path_under_an_operator_writable_prefix_is_the_jobs_root(tmp_path):
    writable = tmp_path / "shared-ckpt"
    settings = ServiceSettings(data_dir=tmp_path / "data", device="cpu", writable_paths=(writable,))
    service = Service(settings)
    try:
        body = {**REFERENCE_TRAINING_INIT, "checkpoint_path": str(writable / "run")}
        with serve_app(make_app(service)) as url, httpx.Client(base_url=url, timeout=120) as http:
            response = http.post("/initialize", json=body)
            assert response.status_code == 200, response.text
            trainer = service.resolve(response.json()["job_id"], owner=None).engine
            assert Path(trainer.config.checkpoint_dir) == (writable / "run").resolve()
    finally:
        service.close()


def test_initialize_with_a_bad_reference_field_names_it(http, service):
    body = {**REFERENCE_TRAINING_INIT, "ds_config": {"optimizer": {"params": {"lr": -1}}}}
    response = http.post("/initialize", json=body)
    assert response.status_code == 400 and "lr" in response.text
    assert http.get("/status").json()["jobs"] == {}
