"""The engines on a CUDA device: bf16 training, our sampler, in-process weight sync, FSDP on one
GPU, and SkyRL's flash-attention default.

Every test needs a CUDA device and is skipped without one (CI has none); a GPU machine runs them
with ``bash benchmarks/gpu_check.sh`` (README, "GPU check"). They use the built-in models, so
nothing is downloaded. Numbers are checked against independent computations: the CPU engine,
transformers' own greedy ``generate``, the plain (unsharded) engine.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here; tests/gpu runs on a GPU machine: bash benchmarks/gpu_check.sh",
)

MODEL = "builtin:small"
SCORING = {"post": ["compute_entropy_and_logprobs"], "loss_fn": None}


def batch(rows: int = 4, prompt: int = 24, response: int = 40, seed: int = 0) -> dict:
    """A verl-layout GRPO batch of random token ids with random advantages and no padding."""
    from arctic_platform.layout import training_batch

    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 90, size=(rows, prompt + response)).tolist()
    out = training_batch(
        [r[:prompt] for r in ids],
        [r[prompt:] for r in ids],
        pad_token_id=0,
        advantages=rng.standard_normal(rows).astype(np.float32),
    )
    out["old_log_probs"] = np.zeros(out["input_ids"].shape, dtype=np.float32)
    return out


def meta(rows: dict) -> dict:
    mask = rows["response_mask"]
    return {"pad_token_id": 0, "batch_num_tokens": int(mask.sum()), "global_batch_size": len(mask)}


def trainer(device: str, dtype: str, **settings):
    from arctic_platform.engine.config import ModelConfig, OptimizerConfig, TrainingEngineConfig
    from arctic_platform.engine.trainer import TrainingEngine

    model = ModelConfig(name=MODEL, device=device, dtype=dtype)
    config = TrainingEngineConfig(model=model, optimizer=OptimizerConfig(lr=1e-3), seed=1)
    parallel = settings.pop("parallel", None)
    return TrainingEngine(config.model_copy(update=settings), parallel=parallel)


def sampler(device: str, dtype: str):
    from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
    from arctic_platform.engine.sampler import SamplingEngine

    model = ModelConfig(name=MODEL, device=device, dtype=dtype)
    return SamplingEngine(SamplingEngineConfig(model=model, max_model_len=256, seed=1))


def test_a_grpo_run_in_bf16_on_cuda(tmp_path):
    """The whole client loop (generate, score, fwd_bwd, step, sync, save, load) on the GPU in
    the engines' CUDA default, bf16."""
    from arctic_platform.client import create_arctic_rl_client
    from tests.client.grpo import run_grpo

    config = {
        "model": MODEL,
        "dtype": "bfloat16",  # also the CUDA default ("auto")
        "seed": 3,
        "tensor_type": "numpy",
        "backend": {"type": "inprocess", "data_dir": str(tmp_path), "device": "cuda"},
        "training": {"optimizer": {"lr": 1e-3}},
        "sampling": {},
        "log_prob": {},
    }
    client = create_arctic_rl_client(config, blocking_calls=True)
    try:
        run = run_grpo(client)
        service = client.get_server_state()
        for job_id in (client.training_job_id, client.sampling_job_id):
            model = service.resolve(job_id, owner=None).engine.model
            param = next(model.parameters())
            assert param.device.type == "cuda" and param.dtype == torch.bfloat16, job_id
    finally:
        client.shutdown()
    assert math.isfinite(run["fwd_bwd"]["loss"]) and run["step"]["grad_norm"] > 0
    mask = run["batch"]["response_mask"].astype(bool)
    before, after = run["old"]["batch"]["logprobs"], run["final"]["batch"]["logprobs"]
    assert np.isfinite(after[mask]).all() and np.abs(after[mask] - before[mask]).max() > 1e-3
    assert run["generate_after_sync"] != run["generate"]  # the sync reached the sampler


def test_cuda_scores_and_trains_like_the_cpu_engine():
    """float32 on both devices: the same log-probs, loss and gradient norm to float rounding."""
    rows = batch()
    answers = {}
    for device in ("cpu", "cuda"):
        engine = trainer(device, "float32")
        scored = engine.forward(rows, processing=SCORING)["logprobs"].float().cpu().numpy()
        result = engine.forward_backward(rows, meta(rows), {"loss_fn": "verl_grpo"})
        answers[device] = (scored, float(result["loss"]), engine.step()["grad_norm"])
    np.testing.assert_allclose(answers["cuda"][0], answers["cpu"][0], atol=2e-4)
    assert answers["cuda"][1] == pytest.approx(answers["cpu"][1], rel=1e-4, abs=1e-6)
    assert answers["cuda"][2] == pytest.approx(answers["cpu"][2], rel=1e-3)


def test_greedy_sampling_on_cuda_equals_transformers_generate():
    from transformers import AutoModelForCausalLM

    from arctic_platform.engine.builtin import resolve_model_path

    ours = sampler("cuda", "float32")
    prompts = [[40, 41, 42, 43], [50, 51, 52]]
    samples = ours.generate(prompts, {"temperature": 0.0, "max_tokens": 16})
    reference = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(MODEL), dtype=torch.float32
    ).to("cuda")
    for prompt, sample in zip(prompts, samples, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = reference.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16
            )
        expected = out[0, len(prompt) :].tolist()
        assert sample["token_ids"] == expected[: len(sample["token_ids"])]
        assert len(sample["token_ids"]) == len(expected)


def test_in_process_weight_sync_on_cuda_copies_every_tensor_exactly():
    from arctic_platform.engine.weights import sync_in_process

    train, sample = trainer("cuda", "bfloat16"), sampler("cuda", "bfloat16")
    rows = batch()
    probe = [[40, 41, 42]]
    params = {"temperature": 0.0, "max_tokens": 12, "min_tokens": 12}
    before = sample.generate(probe, params)[0]["token_ids"]
    train.forward_backward(rows, meta(rows), {"loss_fn": "verl_grpo"})
    train.step()
    sync_in_process(train.model, sample)
    theirs = dict(sample.model.named_parameters())
    for name, tensor in train.model.named_parameters():
        assert torch.equal(tensor.detach(), theirs[name].detach()), name
        assert theirs[name].device.type == "cuda", name
    fresh = sampler("cuda", "bfloat16")
    sync_in_process(train.model, fresh)
    after = sample.generate(probe, params)[0]["token_ids"]
    assert after == fresh.generate(probe, params)[0]["token_ids"]
    assert after != before


@pytest.fixture
def one_rank_group():
    """A one-rank NCCL process group, left at the end."""
    from arctic_platform.engine.data_parallel import (
        join_process_group,
        leave_process_group,
        open_rendezvous,
    )

    store = open_rendezvous("127.0.0.1", 1, timeout_s=60)
    assert join_process_group(0, 1, "127.0.0.1", store.port, timeout_s=60, store=store) == "nccl"
    yield
    leave_process_group()


def test_fsdp_on_one_gpu_trains_like_the_plain_engine(one_rank_group):
    """The FSDP strategy (FSDP2 per block, built directly: ``data_parallel_strategy`` maps one
    rank to the plain engine) over a one-rank NCCL group, against the plain engine."""
    from arctic_platform.engine.data_parallel import FsdpStrategy

    rows = batch()
    answers = {}
    for name, parallel in (("plain", None), ("fsdp", FsdpStrategy(rank=0, world_size=1))):
        engine = trainer("cuda", "float32", parallel=parallel, prompt_sharing="off")
        result = engine.forward_backward(rows, meta(rows), {"loss_fn": "verl_grpo"})
        norm = engine.step()["grad_norm"]
        scored = engine.forward(rows, processing=SCORING)["logprobs"].float().cpu().numpy()
        answers[name] = (float(result["loss"]), norm, scored)
        del engine
    assert answers["fsdp"][0] == pytest.approx(answers["plain"][0], rel=1e-5, abs=1e-6)
    assert answers["fsdp"][1] == pytest.approx(answers["plain"][1], rel=1e-4)
    np.testing.assert_allclose(answers["fsdp"][2], answers["plain"][2], atol=1e-4)


def test_skyrls_flash_attention_default_runs_on_cuda():
    """flash_attention_2 runs where flash_attn is installed; elsewhere it is an sdpa fallback
    the engine reports. Either way a bf16 fwd_bwd runs."""
    from arctic_platform.engine.config import ModelConfig

    engine = trainer(
        "cuda",
        "bfloat16",
        model=ModelConfig(
            name=MODEL, device="cuda", dtype="bfloat16", attn_implementation="flash_attention_2"
        ),
    )
    rows = batch()
    assert math.isfinite(engine.forward_backward(rows, meta(rows))["loss"])
    if importlib.util.find_spec("flash_attn") is None:
        assert engine.model.config._attn_implementation == "sdpa"
        assert engine.setting_fallbacks == {
            "attn_implementation": "flash_attention_2 -> sdpa (flash_attn is not installed)"
        }
    else:
        assert engine.model.config._attn_implementation == "flash_attention_2"
        assert engine.setting_fallbacks == {}


def test_decoding_on_cuda_never_plans_cudnn_attention():
    """SDPA's cuDNN kernels plan per shape (a new plan at every decode step, ~1.7 ms of CPU per
    layer on an H200); the engines keep SDPA on its shape-free kernels. Profiled, a generate
    runs no cuDNN attention (and does run attention)."""
    from torch.profiler import ProfilerActivity, profile

    ours = sampler("cuda", "bfloat16")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ours.generate([[40, 41, 42, 43]] * 4, {"temperature": 0.0, "max_tokens": 8})
    names = {event.key for event in prof.key_averages()}
    assert not [name for name in names if "cudnn_attention" in name], sorted(names)
    assert any("attention" in name for name in names), sorted(names)  # attention was profiled
