"""The engine on one GPU, at real model size: training and sampling throughput, MFU, memory.

A Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16 query / 8 key-value heads of 128,
intermediate 3072, the 151,936-token vocabulary, tied embeddings: ``QWEN3_0_6B``) is built
locally with random weights and a word-level tokenizer covering its whole vocabulary, written as
an ordinary HF folder, and loaded by the engines as any checkpoint is. Nothing is downloaded.

Measured (they run as train, sample, weight sync, transformers' ``generate``, fsdp; the trainer
and sampler are released after the weight sync, before the others load their own models):

1. **train**: ``TrainingEngine`` in bf16, GRPO ``fwd_bwd`` (``verl_grpo``) over ``--rows`` x
   ``--seq`` tokens split into microbatches of ``--microbatch-tokens``, then ``step``; the median
   of ``--repeat`` timed iterations after one warm-up. Tokens/s, MFU, peak GPU memory; the same
   for the ``fwd_no_grad`` that scores old log-probs.
2. **fsdp**: the same ``fwd_bwd`` with the engine's FSDP strategy (``FsdpStrategy``, FSDP2
   ``fully_shard`` per block) on a one-rank process group (NCCL on CUDA, gloo on CPU):
   ``data_parallel_strategy`` maps one rank to the plain engine, so the strategy is built directly
   to run its code on one GPU. Its first loss must equal the plain engine's.
3. **sample**: ``SamplingEngine`` in bf16, ``--prompts`` prompts of ``--prompt-len`` tokens,
   ``--gen-len`` new tokens each (``min_tokens`` = ``max_tokens``, so every sample runs to
   length). Generated tokens/s, against the baseline a user has without us measured in the same
   run: transformers' ``generate`` on the same model and prompts, at torch's default attention
   backends and with cuDNN's off as our engines run (``hf_generate``,
   ``hf_generate_no_cudnn_sdp``). ``--profile FOLDER`` also writes where a short ``generate``'s
   time goes, ours and each baseline's (``torch.profiler`` and ``cProfile`` tables).
4. **weight sync**: trainer -> sampler in process (``sync_in_process``) after a step; the
   sampler's tensors must then equal the trainer's exactly.

MFU = model FLOPs / time / peak. Model FLOPs per token (PaLM, appendix B): ``6 N + 12 L H d S``
for ``fwd_bwd`` and ``2 N + 4 L H d S`` for a forward alone, where N is the parameter count with
the tied embedding counted once (the LM head's matmul; the embedding lookup costs nothing), L
layers, H query heads of d dims, S the row length (the full S x S score matrix is counted, as
PaLM does). Peak: the H200's dense bf16 rate from its datasheet, 989 TFLOP/s (``--peak-tflops``);
a matmul measured here reached about 790.

Run on a GPU: ``python -m benchmarks.gpu_smoke`` (``benchmarks/gpu_check.sh`` runs it with the
GPU tests); ``--phases sample`` (comma-separated) runs only some phases. A phase that fails
records its error and the others still run. On a CPU, ``--device cpu --tiny`` runs the same
path on a tiny model in seconds.
Writes ``benchmarks/results/gpu_smoke.json`` (or ``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks._common import RESULTS_DIR, machine

QWEN3_0_6B = {
    "vocab_size": 151_936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40_960,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# The same architecture at a size a CPU runs in seconds (the dry run).
TINY = {
    **QWEN3_0_6B,
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
}
# Workload sizes: (rows, seq, microbatch tokens, prompts, prompt len, gen len, repeat).
FULL_SIZES = {"rows": 16, "seq": 1024, "microbatch_tokens": 8192}
FULL_SIZES |= {"prompts": 64, "prompt_len": 128, "gen_len": 256, "repeat": 5}
TINY_SIZES = {"rows": 4, "seq": 64, "microbatch_tokens": 128}
TINY_SIZES |= {"prompts": 4, "prompt_len": 16, "gen_len": 16, "repeat": 2}
H200_BF16_DENSE_TFLOPS = 989.0
# Decode steps of the profiled calls (short: the profiler's own cost grows with the call).
PROFILE_STEPS = 32
# The phases, in the order they run (``--phases`` picks some; weight sync needs train and sample).
PHASES = ("train", "sample", "weight_sync", "fsdp")
PAD, EOS = "<|endoftext|>", "<|im_end|>"
SEED = 0
LR = 1e-3


# -- the model -------------------------------------------------------------------------------


def write_model(shape: dict, folder: Path, device: str) -> Path:
    """A random Qwen3 model of ``shape`` and a word-level tokenizer over its whole vocabulary
    (``t<id>`` per id, so every sampled id decodes), saved in bf16 as an HF folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {PAD: 0, EOS: 1} | {f"t{i}": i for i in range(2, shape["vocab_size"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS)
    config = Qwen3Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def model_flops_per_token(shape: dict, params: int, seq: int, *, backward: bool) -> float:
    """PaLM's model FLOPs per token (module doc): ``6N + 12LHdS``, or ``2N + 4LHdS`` forward."""
    attention = shape["num_hidden_layers"] * shape["num_attention_heads"] * shape["head_dim"] * seq
    return (6 * params + 12 * attention) if backward else (2 * params + 4 * attention)


# -- measuring -------------------------------------------------------------------------------


class Gpu:
    """Synchronised timing and peak memory on ``device`` (CUDA), or just timing (CPU)."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def timed(self, fn) -> tuple[float, object]:
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - start, out

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return self.torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


def grpo_batch(rows: int, seq: int, vocab: int) -> dict:
    """``rows`` prompt+response rows of ``seq`` tokens (a quarter prompt) with random ids and
    advantages, in the verl layout every RL framework sends."""
    import numpy as np

    from arctic_platform.layout import training_batch

    rng = np.random.default_rng(SEED)
    prompt = seq // 4
    ids = rng.integers(2, vocab, size=(rows, seq)).tolist()
    advantages = rng.standard_normal(rows).astype(np.float32)
    return training_batch(
        [r[:prompt] for r in ids], [r[prompt:] for r in ids], pad_token_id=0, advantages=advantages
    )


def train_config(folder: Path, device: str, sizes: dict):
    from arctic_platform.engine.config import ModelConfig, OptimizerConfig, TrainingEngineConfig

    return TrainingEngineConfig(
        model=ModelConfig(name=str(folder), device=device, dtype="auto"),
        # Large enough that a step moves bf16 weights (smaller updates round away), so the
        # weight sync phase sees the sampler's output change.
        optimizer=OptimizerConfig(lr=LR),
        max_tokens_per_microbatch=sizes["microbatch_tokens"],
        prompt_sharing="off",  # distinct prompts: nothing to share
        seed=SEED,
    )


def train_envelope(engine, batch: dict) -> dict:
    """The GRPO ``fwd_bwd`` request: old log-probs scored by the engine itself."""
    import numpy as np

    scoring = {"post": ["compute_entropy_and_logprobs"], "loss_fn": None}
    old = engine.forward(batch, processing=scoring)["logprobs"].float().cpu().numpy()
    mask = batch["response_mask"]
    meta = {
        "pad_token_id": 0,
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": len(mask),
        "temperature": 1.0,
    }
    tensors = {**batch, "old_log_probs": (old * mask).astype(np.float32)}
    return {"batch": tensors, "meta": meta, "processing": {"loss_fn": "verl_grpo"}}


def measure_train(engine, gpu: Gpu, batch: dict, sizes: dict, shape: dict) -> dict:
    """Warm-up, then ``repeat`` timed ``fwd_no_grad`` / ``fwd_bwd`` / ``step`` iterations."""
    params = sum(p.numel() for p in engine.model.parameters())
    envelope = train_envelope(engine, batch)
    scoring = {"post": ["compute_entropy_and_logprobs"], "loss_fn": None}
    first = engine.forward_backward(**envelope)
    engine.step()
    gpu.reset_peak()
    times: dict[str, list[float]] = {"fwd_no_grad": [], "fwd_bwd": [], "step": []}
    losses = []
    for _ in range(sizes["repeat"]):
        seconds, _ = gpu.timed(lambda: engine.forward(batch, processing=scoring))
        times["fwd_no_grad"].append(seconds)
        seconds, result = gpu.timed(lambda: engine.forward_backward(**envelope))
        times["fwd_bwd"].append(seconds)
        losses.append(float(result["loss"]))
        seconds, _ = gpu.timed(engine.step)
        times["step"].append(seconds)
    tokens = int(batch["attention_mask"].sum())
    seq = batch["input_ids"].shape[1]
    out = {"parameters": params, "tokens_per_iteration": tokens, "first_loss": float(first["loss"])}
    for name in ("fwd_no_grad", "fwd_bwd"):
        median = statistics.median(times[name])
        flops = tokens * model_flops_per_token(shape, params, seq, backward=name == "fwd_bwd")
        out[name] = {
            "median_s": median,
            "tokens_per_s": tokens / median,
            "model_tflops_per_s": flops / median / 1e12,
        }
    out["step_median_s"] = statistics.median(times["step"])
    out["peak_gpu_gib"] = gpu.peak_gib()
    out["losses_finite"] = all(loss == loss and abs(loss) != float("inf") for loss in losses)
    return out


def run_train(folder: Path, device: str, gpu: Gpu, sizes: dict, shape: dict) -> tuple:
    """Phase 1; returns its figures and the engine (kept for the weight sync phase)."""
    from arctic_platform.engine.trainer import TrainingEngine

    engine = TrainingEngine(train_config(folder, device, sizes))
    batch = grpo_batch(sizes["rows"], sizes["seq"], shape["vocab_size"])
    return measure_train(engine, gpu, batch, sizes, shape), engine


def run_fsdp(folder: Path, device: str, gpu: Gpu, sizes: dict, shape: dict) -> dict:
    """Phase 2: the FSDP strategy on a one-rank process group."""
    from arctic_platform.engine.data_parallel import (
        FsdpStrategy,
        join_process_group,
        leave_process_group,
        open_rendezvous,
    )
    from arctic_platform.engine.trainer import TrainingEngine

    store = open_rendezvous("127.0.0.1", 1, timeout_s=60)
    backend = join_process_group(0, 1, "127.0.0.1", store.port, timeout_s=60, store=store)
    try:
        engine = TrainingEngine(
            train_config(folder, device, sizes), parallel=FsdpStrategy(rank=0, world_size=1)
        )
        batch = grpo_batch(sizes["rows"], sizes["seq"], shape["vocab_size"])
        out = {"backend": backend, **measure_train(engine, gpu, batch, sizes, shape)}
        del engine
    finally:
        leave_process_group()
    return out


def sample_prompts(sizes: dict, shape: dict) -> list[list[int]]:
    """The sampling phase's prompts: ``prompts`` random rows of ``prompt_len`` ids."""
    import numpy as np

    rng = np.random.default_rng(SEED + 1)
    shape_ = (sizes["prompts"], sizes["prompt_len"])
    return rng.integers(2, shape["vocab_size"], size=shape_).tolist()


def run_sample(folder: Path, device: str, gpu: Gpu, sizes: dict, prompts: list) -> tuple:
    """Phase 3; returns its figures and the sampler (for the weight sync phase)."""
    from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
    from arctic_platform.engine.sampler import SamplingEngine

    sampler = SamplingEngine(
        SamplingEngineConfig(
            model=ModelConfig(name=str(folder), device=device, dtype="auto"),
            max_batch_size=sizes["prompts"],
            max_model_len=sizes["prompt_len"] + sizes["gen_len"],
            seed=SEED,
        )
    )
    params = {"max_tokens": sizes["gen_len"], "min_tokens": sizes["gen_len"], "seed": SEED}
    sampler.generate(prompts[:2], {**params, "max_tokens": 4, "min_tokens": 4})  # warm-up
    gpu.reset_peak()
    seconds, samples = gpu.timed(lambda: sampler.generate(prompts, params))
    generated = sum(len(s["token_ids"]) for s in samples)
    figures = {
        "prompts": len(prompts),
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "all_full_length": all(len(s["token_ids"]) == sizes["gen_len"] for s in samples),
        "peak_gpu_gib": gpu.peak_gib(),
    }
    return figures, sampler, (prompts[:4], params)


def hf_generate(
    folder: Path,
    device: str,
    gpu: Gpu,
    prompts: list,
    gen_len: int,
    *,
    cudnn_sdp: bool,
    profile: Path | None = None,
) -> dict:
    """The baseline a user has without us: transformers' ``generate`` on the same model and
    prompts, sampling at temperature 1 with no filters, every sample run to ``gen_len``.
    ``cudnn_sdp``: with torch's default attention backends (cuDNN's included), or with cuDNN's
    off as our engines run (:func:`~arctic_platform.engine.models.use_shape_stable_attention`).
    ``profile``: also write where a short ``generate``'s time goes there (:func:`profile_call`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device)
    ids = torch.tensor(prompts, device=device)
    # top_k=0 turns off the saved generation config's default top-k (50)
    settings = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    settings |= {"max_new_tokens": gen_len, "min_new_tokens": gen_len, "pad_token_id": 0}

    def generate(**overrides):
        with torch.no_grad():
            mask = torch.ones_like(ids)
            return model.generate(ids, attention_mask=mask, **(settings | overrides))

    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
    try:
        seconds, out = gpu.timed(generate)
        generated = (out.shape[1] - ids.shape[1]) * len(prompts)
        figures = {"seconds": seconds, "generated_tokens": generated}
        figures["tokens_per_s"] = generated / seconds
        if profile is not None:
            steps = min(PROFILE_STEPS, gen_len)
            short = {"max_new_tokens": steps, "min_new_tokens": steps}
            title = f"transformers' generate, {len(prompts)} x {steps} tokens"
            figures["profile"] = profile_call(lambda: generate(**short), profile, title)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    return figures


def profile_call(call, path: Path, title: str) -> dict:
    """Where ``call()``'s time goes, written to ``path``: ``torch.profiler``'s operator tables
    (by CPU time, and by device time on CUDA) and ``cProfile``'s Python functions (by own time),
    one call under each, after one plain timed call; a launch-bound decode shows as CPU time the
    device waits through."""
    import cProfile
    import io
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    seconds = {}
    start = time.perf_counter()
    call()
    seconds["plain"] = time.perf_counter() - start
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        call()
    seconds["torch_profiler"] = time.perf_counter() - start
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    if torch.cuda.is_available():
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=30))
    python = cProfile.Profile()
    start = time.perf_counter()
    python.runcall(call)
    seconds["cprofile"] = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(40)
    tables.append(text.getvalue())
    header = f"{title}: " + ", ".join(f"{v:.3f} s {k}" for k, v in seconds.items())
    path.write_text(header + "\n\n" + "\n\n".join(tables) + "\n")
    print(f"wrote {path}")
    return {"tables": str(path), **{f"{k}_s": v for k, v in seconds.items()}}


def run_weight_sync(trainer, sampler, gpu: Gpu, probe: tuple) -> dict:
    """Phase 4: the trained weights reach the sampler exactly, and change what it samples."""
    import torch

    from arctic_platform.engine.weights import sync_in_process

    prompts, params = probe
    before = [s["token_ids"] for s in sampler.generate(prompts, params)]
    seconds, _ = gpu.timed(lambda: sync_in_process(trainer.model, sampler))
    theirs = dict(sampler.model.named_parameters())
    equal = all(
        torch.equal(p.detach(), theirs[name].detach())
        for name, p in trainer.model.named_parameters()
    )
    after = [s["token_ids"] for s in sampler.generate(prompts, params)]
    nbytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    return {
        "seconds": seconds,
        "gib": nbytes / 2**30,
        "gib_per_s": nbytes / 2**30 / seconds,
        "sampler_equals_trainer": equal,
        "samples_changed": before != after,
    }


# -- the run ---------------------------------------------------------------------------------


def environment(device: str) -> dict:
    import importlib.util

    import torch
    import transformers

    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
    }
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = list(torch.cuda.get_device_capability(0))
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return env


def run_phase(result: dict, name: str, fn) -> tuple:
    """Run one phase: its figures (``fn``'s first value) go to ``result[name]``, the rest (the
    engines a later phase reuses) are returned. A phase that raises records its error there
    instead and returns ``None``s, so one failure on a machine the code has never run on still
    leaves every other phase's figures (a GPU lease is too short to rerun them all)."""
    print(f"-- {name}", flush=True)
    try:
        figures, *rest = fn()
    except Exception as error:  # recorded, printed, and failed in `checks`
        traceback.print_exc()
        result[name] = {"error": f"{type(error).__name__}: {error}"}
        return (None, None)
    result[name] = figures
    return tuple(rest) + (None,) * (2 - len(rest))


def run(
    device: str,
    tiny: bool,
    peak_tflops: float,
    sizes: dict,
    phases: tuple[str, ...] = PHASES,
    profile: Path | None = None,
) -> dict:
    shape = TINY if tiny else QWEN3_0_6B
    gpu = Gpu(device)
    folder = Path(tempfile.mkdtemp(prefix="gpu-smoke-model-"))
    result: dict = {"device": device, "model_shape": shape, "sizes": sizes, "phases": phases}
    result["environment"] = environment(device)
    trainer = sampler = probe = None
    prompts = sample_prompts(sizes, shape)  # what the sampling phase and its baselines decode
    try:
        seconds, _ = gpu.timed(lambda: write_model(shape, folder, device))
        result["model_write_s"] = seconds
        if "train" in phases:
            trainer, _ = run_phase(
                result, "train", lambda: run_train(folder, device, gpu, sizes, shape)
            )
        if "sample" in phases:
            sampler, probe = run_phase(
                result, "sample", lambda: run_sample(folder, device, gpu, sizes, prompts)
            )
        if profile is not None and sampler is not None:
            steps = min(PROFILE_STEPS, sizes["gen_len"])
            params = {"max_tokens": steps, "min_tokens": steps, "seed": SEED}
            run_phase(
                result,
                "profile",
                lambda: (
                    profile_call(
                        lambda: sampler.generate(prompts, params),
                        profile / "profile_ours.txt",
                        f"our sampler, {len(prompts)} x {steps} tokens",
                    ),
                ),
            )
        if "weight_sync" in phases and trainer is not None and sampler is not None:
            run_phase(
                result, "weight_sync", lambda: (run_weight_sync(trainer, sampler, gpu, probe),)
            )
        trainer = sampler = None  # the engines go before the next phases build their own
        gpu.release()
        if "sample" in phases:
            for name, cudnn_sdp in (("hf_generate", True), ("hf_generate_no_cudnn_sdp", False)):
                run_phase(
                    result,
                    name,
                    lambda name=name, cudnn_sdp=cudnn_sdp: (
                        hf_generate(
                            folder,
                            device,
                            gpu,
                            prompts,
                            sizes["gen_len"],
                            cudnn_sdp=cudnn_sdp,
                            profile=profile / f"profile_{name}.txt" if profile else None,
                        ),
                    ),
                )
                gpu.release()
        if "fsdp" in phases:
            run_phase(result, "fsdp", lambda: (run_fsdp(folder, device, gpu, sizes, shape),))
            gpu.release()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ours = result.get("sample", {})
    for name in ("hf_generate", "hf_generate_no_cudnn_sdp"):
        theirs = result.get(name, {})
        if "tokens_per_s" in ours and "tokens_per_s" in theirs:
            ours[f"ratio_to_{name}"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    for phase in ("train", "fsdp"):
        for name in ("fwd_no_grad", "fwd_bwd"):
            if figures := (result.get(phase) or {}).get(name):
                figures["mfu"] = figures["model_tflops_per_s"] / peak_tflops
    if "first_loss" in (result.get("fsdp") or {}) and "first_loss" in (result.get("train") or {}):
        result["fsdp"]["first_loss_matches_plain"] = abs(
            result["fsdp"]["first_loss"] - result["train"]["first_loss"]
        ) <= 1e-2 * max(1.0, abs(result["train"]["first_loss"]))
    result["peak_tflops"] = peak_tflops
    result["mfu_formula"] = (
        "tokens * (6N + 12*L*H*d*S) / seconds / peak for fwd_bwd, (2N + 4*L*H*d*S) for "
        "fwd_no_grad; N = parameters (tied embedding once), L layers, H query heads, d head dim, "
        "S row length"
    )
    return result


def table(result: dict) -> str:
    """The figures as a plain text table."""

    def fmt(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    rows = [("phase", "op", "tokens/s", "TFLOP/s", "MFU", "peak GiB")]
    for phase in ("train", "fsdp"):
        if phase not in result["phases"]:
            continue
        if "error" in result.get(phase, {"error": "not run"}):  # its traceback is in the log
            rows.append((phase, "failed", "-", "-", "-", "-"))
            continue
        for name in ("fwd_no_grad", "fwd_bwd"):
            f = result[phase][name]
            rows.append(
                (
                    phase,
                    name,
                    fmt(f["tokens_per_s"], ",.0f"),
                    fmt(f["model_tflops_per_s"]),
                    fmt(f["mfu"], ".1%"),
                    fmt(result[phase]["peak_gpu_gib"]),
                )
            )
    sample = result.get("sample", {})
    rows.append(
        (
            "sample",
            "generate",
            fmt(sample.get("tokens_per_s"), ",.0f"),
            "-",
            "-",
            fmt(sample.get("peak_gpu_gib")),
        )
    )
    for name, label in (("hf_generate", "hf"), ("hf_generate_no_cudnn_sdp", "hf, no cuDNN")):
        hf, ratio = result.get(name, {}), sample.get(f"ratio_to_{name}")
        rows.append((label, "generate", fmt(hf.get("tokens_per_s"), ",.0f"), "-", "-", "-"))
        rows.append(
            (f"ours/{label}", "-", fmt(ratio, ".2f") + "x" if ratio else "-", "-", "-", "-")
        )
    sync = result.get("weight_sync", {})
    gib, rate = fmt(sync.get("gib"), ".2f"), fmt(sync.get("gib_per_s"))
    rows.append(("sync", f"{gib} GiB", f"{rate} GiB/s", "-", "-", "-"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows
    )


def checks(result: dict, phases: tuple[str, ...] = PHASES) -> dict[str, bool]:
    """What must hold for the run to count (the exit status says whether all did), for the
    phases asked for; a phase that failed or did not run fails its checks."""

    def got(phase: str, key: str) -> bool:
        return bool(result.get(phase, {}).get(key, False))

    ratio = result.get("sample", {}).get("ratio_to_hf_generate", 0.0)

    wanted = {
        "train": {"train losses finite": got("train", "losses_finite")},
        "sample": {
            "every sample ran to length": got("sample", "all_full_length"),
            "transformers' generate ran": "tokens_per_s" in result.get("hf_generate", {}),
            "ours is faster than transformers' generate": ratio > 1.0,
        },
        "weight_sync": {
            "sampler equals trainer after sync": got("weight_sync", "sampler_equals_trainer"),
            "the sync changed what the sampler samples": got("weight_sync", "samples_changed"),
        },
        "fsdp": {
            "fsdp losses finite": got("fsdp", "losses_finite"),
            "fsdp first loss equals the plain engine's": got("fsdp", "first_loss_matches_plain"),
        },
    }
    return {name: ok for phase in phases for name, ok in wanted[phase].items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (CPU dry run)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_smoke.json")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset")
    parser.add_argument(
        "--profile", type=Path, help="a folder: write where each generate's time goes there"
    )
    for name in FULL_SIZES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    args = parser.parse_args(argv)
    sizes = dict(TINY_SIZES if args.tiny else FULL_SIZES)
    sizes.update({k: getattr(args, k) for k in FULL_SIZES if getattr(args, k) is not None})
    phases = tuple(args.phases.split(","))
    if unknown := set(phases) - set(PHASES):
        parser.error(f"--phases: unknown {sorted(unknown)}; choose from {', '.join(PHASES)}")
    result = run(args.device, args.tiny, args.peak_tflops, sizes, phases, args.profile)
    result["checks"] = checks(result, phases)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"benchmark": "gpu_smoke", "machine": machine(), **result}, indent=2)
    args.out.write_text(text + "\n")
    print(table(result))
    for name, ok in result["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(f"wrote {args.out}")
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
