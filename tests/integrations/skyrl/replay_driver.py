"""SkyRL's ``integrations/arctic_rl`` call sequence, replayed as a driver process.

Run as ``python -m tests.integrations.skyrl.replay_driver PROTOCOL`` in an empty folder. It does
what SkyRL's ``entrypoint.main()`` does (facts: shared/reference/skyrl_tinker.md §1): build the
flat ``ArcticRLClientConfig`` as ``build_rl_config`` does, create the pre-client, read
``rl_config.comm_protocol`` to decide whether to ship ``get_server_state()``, then run the
experiment in a ``@ray.remote(num_cpus=1)`` task that reattaches from ``reconnect_config()``. The
task generates on its own event loop and runs ``fwd_no_grad``/``fwd_bwd``/``step``/
``save_checkpoint`` through ``_run`` (``asyncio.run`` fails inside the running loop, so a fresh
loop in a worker thread), exactly like SkyRL's ``_ArcticDispatch``. Nobody calls ``shutdown()``.

One deviation: SkyRL's own ``ray.init()`` names no address and so joins any cluster running on
the machine; here it starts a private one (``address="local"``), because other clusters run on
test machines. The driver prints one JSON line with what SkyRL reads from each response.
"""

from __future__ import annotations

import asyncio
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PROMPTS = ["1+2=", "3+4="]
N = 2  # generator.n_samples_per_prompt
MAX_TOKENS = 6  # generator.sampling_params.max_generate_length
MAX_PROMPT = 58  # trainer.max_prompt_length
# SkyRL's defaults that reach the config: trainer.policy.optimizer_config (lr, weight_decay,
# max_grad_norm), generator.inference_engine.gpu_memory_utilization, and ArcticRLTrainerConfig's
# own (integrations/arctic_rl/config.py): ZoRRO on, ZeRO stage 0, liger, flash-attention 2,
# gradient checkpointing, chunked logits ("memory", 4 GiB), Arctic Inference on, vLLM knobs.
LR, WEIGHT_DECAY, GRAD_CLIP, BETAS, EPS = 1e-6, 1e-2, 1.0, [0.9, 0.999], 1e-8
ATTN = "flash_attention_2"


def build_rl_config(protocol: str) -> dict:
    """What SkyRL's ``build_rl_config`` returns with every SkyRL and ``trainer.arctic_rl`` default
    left as is; only the sizes are CPU-sized (a built-in model, 2 prompts x 2 samples, 1 GPU for
    each of training and sampling, as ``policy_num_gpus_per_node=1`` and ``num_engines=1``)."""
    max_length = MAX_PROMPT + MAX_TOKENS
    mini_batch = len(PROMPTS) * N  # policy_mini_batch_size * n_samples_per_prompt
    micro = N  # ZoRRO on: one prompt group per micro-batch
    return {
        "model_name": "builtin:tiny",
        "backend": "local",
        "comm_protocol": protocol,  # SkyRL always says "ray"; the replay runs both protocols
        # Absolute, as SkyRL's trainer.ckpt_path (~/ckpts/...): outside the server's data folder,
        # which the server this driver launched (http) or its state actor (ray) accepts.
        "checkpoint_path": str(Path.cwd() / "ckpts"),
        "training_gpus": 1,
        "sampling_gpus": 1,
        "log_prob_gpus": 0,
        "log_prob_engine": "vllm",
        "colocate": False,
        "vllm_config": {
            "tensor_parallel_size": 1,
            "gpu_memory_utilization": 0.8,
            "max_model_len": max_length,
            "max_num_seqs": 256,
            "enforce_eager": True,
            "enable_chunked_prefill": True,
            "enable_prefix_caching": True,
            "forest_cascade_attn_configs": "{}",  # use_arctic_inference (one engine)
        },
        "ds_config": {
            "train_micro_batch_size_per_gpu": micro,
            "train_batch_size": mini_batch,
            "gradient_accumulation_steps": mini_batch // micro,
            "sequence_parallel_size": 1,
            "bf16": {"enabled": True},
            "gradient_clipping": GRAD_CLIP,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY},
            },
            "zero_optimization": {
                "stage": 0,
                "offload_optimizer": {"device": "none"},
                "offload_param": {"device": "none"},
            },
        },
        "ds_worker_config": {
            "use_liger": True,
            "enable_gradient_checkpointing": True,
            "attn_implementation": ATTN,
            "zorro_train_enable": True,
            "response_len": MAX_TOKENS,
            "max_token_len": MAX_PROMPT + N * MAX_TOKENS,
            "rollout_n": N,
            "temperature": 1.0,
            "use_unpad": True,
            "logits_optimization": "memory",
            "logits_optimization_peak_mem_size_in_gib": 4.0,
            "logits_compute_from_fp32_inputs": False,
            "logits_compute_in_fp32": False,
        },
        "training_config": {
            "training_horizon": 1000,
            "optimizer": {
                "lr": LR,
                "weight_decay": WEIGHT_DECAY,
                "betas": BETAS,
                "gradient_clipping": GRAD_CLIP,
            },
            "lr_scheduler": {"type": "constant", "warmup_ratio": 0.0},
            "max_length": max_length,
            "model_config": None,
            "attn_implementation": ATTN,
        },
        "arctic_inference_config": None,
        "full_determinism": False,
        "seed": 42,
        "startup_timeout": 300.0,
        "server_logs": False,
        # Not a SkyRL field: a free port, so parallel test runs do not meet on 7000.
        **({"port": 0} if protocol == "http" else {}),
    }


def _run(coro):
    """SkyRL's ``trainer._run``: asyncio.run, else a fresh loop in a worker thread."""
    try:
        return asyncio.run(coro)
    except RuntimeError:
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.new_event_loop().run_until_complete, coro).result()


def repack(tokenizer, results: list[dict]) -> tuple[dict, dict]:
    """SkyRL's ``_repack_to_verl_shape`` + ``_build_meta`` for one GRPO step."""
    from arctic_platform.advantages import grpo_advantages
    from arctic_platform.layout import training_batch

    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    rewards = np.array([sum(ch.isdigit() for ch in r["text"]) for r in results], dtype=float)
    batch = training_batch(
        [prompt_ids[i // N] for i in range(len(results))],
        [r["token_ids"] for r in results],
        pad_token_id=tokenizer.pad_token_id,
        advantages=grpo_advantages(rewards, group_size=N),
    )
    batch = {k: np.ascontiguousarray(v) for k, v in batch.items()}
    batch["response_mask"] = batch["response_mask"].astype(np.int64)
    batch["loss_mask"] = batch["response_mask"]
    meta = {
        "pad_token_id": tokenizer.pad_token_id,
        "rollout_n": N,
        "max_prompt_len": batch["prompts"].shape[1],
        "max_response_len": batch["responses"].shape[1],
        "max_token_len_per_gpu": MAX_PROMPT + N * MAX_TOKENS,  # ZoRRO on
        "temperature": 1.0,
        "calculate_entropy": True,
        "drop_position_ids": False,
        "logits_optimization": "none",
        "logits_optimization_peak_mem_size_in_gib": 4,
        "logits_compute_in_fp32": False,
        "dp_size": 1,
        "batch_num_tokens": int(batch["response_mask"].sum()),
        "global_batch_size": len(results),
        "rollout_is_weights": None,
        "zorro_train_enable": True,
        "zorro_train_max_rollouts": N,
        "zorro_train_load_balancer": True,
    }
    return batch, meta


def experiment(reconnect_config, server_state) -> dict:
    """``ArcticRLExp(...).run()`` reduced to the client calls of one training step."""
    from arctic_platform.engine.config import ModelConfig
    from arctic_platform.engine.models import load_tokenizer
    from arctic_platform.rl import create_arctic_rl_client

    client = create_arctic_rl_client(reconnect_config, server_state)
    tokenizer = load_tokenizer(ModelConfig(name="builtin:tiny"))
    sampling_params = {  # get_vllm_sampling_params(cfg.generator.sampling_params)
        "min_tokens": 1,
        "skip_special_tokens": True,
        "include_stop_str_in_output": True,
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "logprobs": 1,
        "stop": None,
    }

    async def trainer_loop() -> dict:
        await client.sync_weights(cuda_ipc=False, low_memory=False)  # save_weights_for_sampler
        prompts = [p for p in PROMPTS for _ in range(N)]
        outputs = await client.generate(prompts=prompts, sampling_params=sampling_params)
        batch, meta = repack(tokenizer, outputs)
        old_payload = {
            "batch": {
                k: batch[k] for k in ("input_ids", "attention_mask", "prompts", "position_ids")
            },
            "meta": {**meta, "calculate_entropy": False},
            "processing": {"post": ["compute_entropy_and_logprobs"], "loss_fn": None},
        }
        old = _run(client.fwd_no_grad(old_payload, reference_model=False))
        logprobs = old["batch"].get("logprobs")
        if logprobs is None:
            logprobs = old["batch"]["log_probs"]
        train_payload = {
            "batch": {**batch, "old_log_probs": np.asarray(logprobs, dtype=np.float32)},
            "meta": {
                **meta,
                "actor_config": {
                    "loss_agg_mode": "token-mean",
                    "kl_loss_coef": 0.001,
                    "kl_loss_type": "low_var_kl",
                    "clip_ratio": 0.2,
                    "clip_ratio_low": 0.2,
                    "clip_ratio_high": 0.2,
                    "clip_ratio_c": 3.0,
                    "entropy_coeff": 0.0,
                    "use_kl_loss": False,
                    "calculate_entropy": True,
                    "rollout_n": N,
                },
                "policy_loss_config": {"loss_mode": "vanilla"},
            },
            "processing": {
                "post": ["apply_temperature", "compute_entropy_and_logprobs"],
                "loss_fn": "verl_grpo",
            },
        }
        result = _run(client.fwd_bwd(train_payload))
        result.pop("job_id", None)
        metrics = result.get("metrics", result)
        step = _run(client.step())
        grad_norm = step.get("metrics", step).get("grad_norm")
        while isinstance(grad_norm, list):
            grad_norm = grad_norm[0]
        saved = _run(client.save_checkpoint())
        await client.sync_weights(cuda_ipc=False, low_memory=False)
        return {
            "outputs": [
                {k: o.get(k) for k in ("token_ids", "text", "finish_reason")} for o in outputs
            ],
            "logprobs_shape": list(np.asarray(logprobs).shape),
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "grad_norm": float(grad_norm),
            "saved": {k: v for k, v in saved.items() if isinstance(v, (str, int))},
            "job_ids": [client.training_job_id, client.sampling_job_id, client.log_prob_job_id],
        }

    return asyncio.run(trainer_loop())


def training_job_info(pre_client, reconnect_cfg, server_state) -> dict:
    """The training sub-job's info (its settings and ``ignored_settings``) as the server lists it:
    ``GET /jobs/{id}`` on the http server, the state actor's ``get_job`` on ray."""
    job_id = pre_client.training_job_id.split(":", 1)[0]
    if server_state is not None:
        import ray

        status, info = ray.get(server_state.get_job.remote(job_id))
        assert status == "ok", info
    else:
        from arctic_platform.client.jobs import JobsClient, ServerAddress

        with JobsClient(ServerAddress(url=reconnect_cfg.backend.base_url)) as jobs:
            info = jobs.show(job_id)
    (training,) = [s for s in info["sub_jobs"] if s["job_type"] == "training"]
    return {k: training[k] for k in ("training_config", "ignored_settings")}


def main(protocol: str) -> None:
    import ray

    from arctic_platform.rl import ArcticRLClientConfig, create_arctic_rl_client

    rl_config = ArcticRLClientConfig(**build_rl_config(protocol))
    pre_client = create_arctic_rl_client(rl_config)
    reconnect_cfg = pre_client.reconnect_config()
    server_state = pre_client.get_server_state() if rl_config.comm_protocol == "ray" else None
    ray.init(address="local", num_gpus=0, ignore_reinit_error=True, include_dashboard=False)
    task = ray.remote(num_cpus=1)(experiment)
    answer = ray.get(task.remote(reconnect_cfg, server_state))
    answer["gcs_address"] = ray.get_runtime_context().gcs_address
    answer["comm_protocol"] = rl_config.comm_protocol
    # Not SkyRL's: what the test checks was reported, from where each backend's users read it.
    answer["client_ignored"] = sorted(rl_config.ignored_settings)
    answer["training_job"] = training_job_info(pre_client, reconnect_cfg, server_state)
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
