"""The engine on one GPU, at real model size: training and sampling throughput, MFU, memory.

A Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16 query / 8 key-value heads of 128,
intermediate 3072, the 151,936-token vocabulary, tied embeddings: ``QWEN3_0_6B``) is built
locally with random weights and a word-level tokenizer covering its whole vocabulary, written as
an ordinary HF folder, and loaded by the engines as any checkpoint is. Nothing is downloaded.

Measured, in this order (each phase releases its engines before the next):

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
   length). Generated tokens/s.
4. **weight sync**: trainer -> sampler in process (``sync_in_process``) after a step; the
   sampler's tensors must then equal the trainer's exactly.

MFU = model FLOPs / time / peak. Model FLOPs per token (PaLM, appendix B): ``6 N + 12 L H d S``
for ``fwd_bwd`` and ``2 N + 4 L H d S`` for a forward alone, where N is the parameter count with
the tied embedding counted once (the LM head's matmul; the embedding lookup costs nothing), L
layers, H query heads of d dims, S the row length (the full S x S score matrix is counted, as
PaLM does). Peak: the H200's dense bf16 rate from its datasheet, 989 TFLOP/s (``--peak-tflops``);
a matmul measured here reached about 790.

Run on a GPU: ``python -m benchmarks.gpu_smoke`` (``benchmarks/gpu_check.sh`` runs it with the
GPU tests). On a CPU, ``--device cpu --tiny`` runs the same path on a tiny model in seconds.
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


def run_sample(folder: Path, device: str, gpu: Gpu, sizes: dict, shape: dict) -> tuple:
    """Phase 3; returns its figures and the sampler (for the weight sync phase)."""
    import numpy as np

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
    rng = np.random.default_rng(SEED + 1)
    prompts = rng.integers(2, shape["vocab_size"], size=(sizes["prompts"], sizes["prompt_len"]))
    prompts = prompts.tolist()
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


def run(device: str, tiny: bool, peak_tflops: float, sizes: dict) -> dict:
    shape = TINY if tiny else QWEN3_0_6B
    gpu = Gpu(device)
    folder = Path(tempfile.mkdtemp(prefix="gpu-smoke-model-"))
    result: dict = {"device": device, "model_shape": shape, "sizes": sizes}
    result["environment"] = environment(device)
    try:
        seconds, _ = gpu.timed(lambda: write_model(shape, folder, device))
        result["model_write_s"] = seconds
        result["train"], trainer = run_train(folder, device, gpu, sizes, shape)
        result["sample"], sampler, probe = run_sample(folder, device, gpu, sizes, shape)
        result["weight_sync"] = run_weight_sync(trainer, sampler, gpu, probe)
        del trainer, sampler
        gpu.release()
        result["fsdp"] = run_fsdp(folder, device, gpu, sizes, shape)
        gpu.release()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for phase in ("train", "fsdp"):
        for name in ("fwd_no_grad", "fwd_bwd"):
            figures = result[phase][name]
            figures["mfu"] = figures["model_tflops_per_s"] / peak_tflops
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
    sample = result["sample"]
    rows.append(
        (
            "sample",
            "generate",
            fmt(sample["tokens_per_s"], ",.0f"),
            "-",
            "-",
            fmt(sample["peak_gpu_gib"]),
        )
    )
    sync = result["weight_sync"]
    rows.append(
        ("sync", f"{fmt(sync['gib'], '.2f')} GiB", f"{fmt(sync['gib_per_s'])} GiB/s", "-", "-", "-")
    )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows
    )


def checks(result: dict) -> dict[str, bool]:
    """What must hold for the run to count (the exit status says whether all did)."""
    return {
        "train losses finite": result["train"]["losses_finite"],
        "fsdp losses finite": result["fsdp"]["losses_finite"],
        "fsdp first loss equals the plain engine's": result["fsdp"]["first_loss_matches_plain"],
        "every sample ran to length": result["sample"]["all_full_length"],
        "sampler equals trainer after sync": result["weight_sync"]["sampler_equals_trainer"],
        "the sync changed what the sampler samples": result["weight_sync"]["samples_changed"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (CPU dry run)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_smoke.json")
    for name in FULL_SIZES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    args = parser.parse_args(argv)
    sizes = dict(TINY_SIZES if args.tiny else FULL_SIZES)
    sizes.update({k: getattr(args, k) for k in FULL_SIZES if getattr(args, k) is not None})
    result = run(args.device, args.tiny, args.peak_tflops, sizes)
    result["checks"] = checks(result)
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
