"""fwd_bwd throughput of the TrainingEngine against a minimal hand-written torch loop.

(a) **overhead**: a batch of equal-length rows (no padding, so both sides do the same model work)
    through ``TrainingEngine.forward_backward`` (``verl_grpo`` loss) vs a hand loop:
    ``model(input_ids, attention_mask).logits``, log_softmax gather, masked token-mean loss,
    ``backward``. Target: engine >= 0.95x.
(b) **packing**: a length-skewed batch (lengths uniform in 16..1024) through the engine with its
    default packing vs the same hand loop on the padded batch. Target: >= 1.5x.

``--suite prompt_sharing`` instead measures prompt sharing (GRPO batches: each prompt sampled
``n = 8`` times), the engine with ``prompt_sharing: auto`` vs ``off`` (today's path), for
``fwd_bwd`` and ``fwd_no_grad``, with tokens/s counting every row's tokens as the unshared pass
does:

(c) **long prompts**: prompt 512 / response 64. Target: fwd_bwd >= 2.5x.
(d) **short prompts**: prompt 64 / response 192, little to share. Target: >= 0.95x (auto must
    never make it slower).

``--suite real_vocab`` measures the chunked LM head at a real vocabulary: a Qwen3-architecture
model with Qwen3's 151,936-token vocabulary (4 layers, hidden 1024, tied embeddings, random
weights, ~0.2 B parameters; built locally by :mod:`benchmarks.local_qwen3`), one GRPO
``fwd_bwd`` + ``step`` on 8 rows x 384 tokens, each side in its own process, one after the other
(peak RSS is the child's ``ru_maxrss``; time is the op's wall time, model load excluded, with its
CPU time beside it, steadier on a loaded machine):

(e) **plain**: the transformers loop a user writes (forward, log-softmax gather,
    advantage-weighted masked mean, backward, AdamW); **whole**: the engine with
    ``logits.optimization: none`` (the whole logits, the path before chunking); **chunked**: the
    engine with its default ``logits`` settings. Targets: chunked peak RSS <= 0.45x plain's,
    chunked time <= whole's.

Throughput is real (non-padding) tokens per second. For each comparison one process loads both
sides and alternates them iteration by iteration (``--warmup`` discarded, then ``--a-repeat`` /
``--b-repeat`` timed pairs; medians), so a machine whose load drifts slows both sides alike.
Peak RSS (``ru_maxrss``) is measured separately, one process per configuration running one
iteration.
Gradients accumulate across iterations on both sides (no optimizer step), so both do the same
work every iteration.

Run: ``python -m benchmarks.engine_train [--suite prompt_sharing|real_vocab]`` (``--help`` for
sizes; ``--threads 1`` on a machine shared with other jobs, where idle-waiting OpenMP threads
distort timings). Writes ``benchmarks/results/engine_train.json`` (or
``engine_train_<suite>.json``) and prints it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

MODEL = "builtin:small"
COMPARISONS = {
    "a": ("engine", "loop"),
    "b": ("engine_packed", "loop_padded"),
    "c": ("shared", "unshared"),
    "d": ("shared", "unshared"),
}
SUITES = {"default": ("a", "b"), "prompt_sharing": ("c", "d"), "real_vocab": ("e",)}
SAMPLES_PER_PROMPT = 8
REAL_VOCAB_SIDES = ("plain", "whole", "chunked")


def fixed_batch(rows: int, prompt: int, response: int, seed: int, vocab: int = 100) -> dict:
    """Equal-length rows: prompt then response, no padding; token ids in ``[5, vocab)``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    width = prompt + response
    input_ids = torch.randint(5, vocab, (rows, width), generator=g)
    response_mask = torch.zeros(rows, width)
    response_mask[:, prompt:] = 1
    return _rl_fields(input_ids, torch.ones(rows, width, dtype=torch.long), response_mask, g)


def skewed_batch(rows: int, low: int, high: int, seed: int, prompt: int = 8) -> dict:
    """Lengths uniform in ``[low, high]``, right-padded to the longest.

    The lengths are a stratified uniform sample (the midpoints of ``rows`` equal strata, shuffled)
    so that a small batch is as skewed as the distribution, not as one lucky draw.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = [int(low + (high - low) * (i + 0.5) / rows) for i in range(rows)]
    lengths = [lengths[i] for i in torch.randperm(rows, generator=g).tolist()]
    width = max(lengths)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    response_mask = torch.zeros(rows, width)
    for b, n in enumerate(lengths):
        input_ids[b, :n] = torch.randint(5, 100, (n,), generator=g)
        attention_mask[b, :n] = 1
        response_mask[b, prompt:n] = 1
    return _rl_fields(input_ids, attention_mask, response_mask, g)


def grpo_batch(prompts: int, prompt: int, response: int, seed: int) -> dict:
    """``prompts`` distinct prompts, each sampled :data:`SAMPLES_PER_PROMPT` times (verl layout)."""
    import numpy as np

    from arctic_platform.layout import training_batch

    rng = np.random.default_rng(seed)
    prompt_ids, response_ids = [], []
    for _ in range(prompts):
        ids = rng.integers(5, 100, prompt).tolist()
        for _ in range(SAMPLES_PER_PROMPT):
            prompt_ids.append(ids)
            response_ids.append(rng.integers(5, 100, response).tolist())
    rows = len(prompt_ids)
    batch = training_batch(
        prompt_ids,
        response_ids,
        pad_token_id=0,
        advantages=rng.normal(size=rows).astype(np.float32),
    )
    batch["old_log_probs"] = np.full(batch["input_ids"].shape, -4.6, np.float32)
    batch["old_log_probs"] *= batch["response_mask"]
    return batch


def _rl_fields(input_ids, attention_mask, response_mask, g) -> dict:
    import torch

    rows = input_ids.shape[0]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "advantages": torch.randn(rows, 1, generator=g) * response_mask,
        "old_log_probs": torch.full(input_ids.shape, -4.6) * response_mask,
    }


def real_vocab_worker(side: str, args) -> dict:
    """One side of (e) in this process: load, then ``--rv-steps`` timed ``fwd_bwd`` + ``step``."""
    import torch

    from benchmarks.local_qwen3 import QWEN3_VOCAB

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch = fixed_batch(args.rv_rows, args.rv_prompt, args.rv_response, seed=5, vocab=QWEN3_VOCAB)
    if side == "plain":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.rv_model, dtype=torch.float32).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

        def step() -> None:
            hand_loop_step(model, batch)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    else:
        from arctic_platform.engine.config import LogitsSettings, ModelConfig, TrainingEngineConfig
        from arctic_platform.engine.trainer import TrainingEngine

        logits = LogitsSettings(optimization="none") if side == "whole" else LogitsSettings()
        engine = TrainingEngine(
            TrainingEngineConfig(
                model=ModelConfig(name=args.rv_model),
                optimizer={"lr": 1e-6},
                seed=0,
                logits=logits,
            )
        )

        def step() -> None:
            engine.forward_backward(batch)
            engine.step()

    def cpu_seconds() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    seconds, cpu = [], []
    for _ in range(args.rv_steps):
        start, start_cpu = time.perf_counter(), cpu_seconds()
        step()
        seconds.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
    return {
        "median_seconds": statistics.median(seconds),
        "all_seconds": seconds,
        "median_cpu_seconds": statistics.median(cpu),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "load_average_1m_after": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
    }


def real_vocab_suite(args, argv: list[str], settings: dict) -> None:
    """(e): build the model once, then each side alone in its own process, one after the other."""
    from benchmarks.local_qwen3 import Qwen3Shape, qwen3_model_path

    shape = Qwen3Shape(layers=args.rv_layers, hidden=args.rv_hidden)
    path = qwen3_model_path(shape)
    report = {}
    for side in REAL_VOCAB_SIDES:
        before = os.getloadavg()[0]
        report[side] = run_in_subprocess(f"real_vocab:{side}", [*argv, f"--rv-model={path}"])
        report[side]["load_average_1m_before"] = before
    from benchmarks._common import write_result

    plain, whole, chunked = (report[side] for side in REAL_VOCAB_SIDES)
    write_result(
        "engine_train_real_vocab",
        {
            "model": {**vars(shape), "path": "qwen3 (benchmarks/local_qwen3.py)"},
            "note": (
                "one GRPO fwd_bwd + step per side, each side alone in its own process, one "
                "after the other; peak RSS is the child's ru_maxrss; time excludes model load; "
                "whole = logits.optimization none, chunked = the default logits settings"
            ),
            "settings": settings,
            "rows": args.rv_rows,
            "tokens_per_row": args.rv_prompt + args.rv_response,
            "rss_ratio_chunked_vs_plain": chunked["peak_rss_mib"] / plain["peak_rss_mib"],
            "target_rss_ratio": 0.45,
            "time_ratio_chunked_vs_whole": chunked["median_seconds"] / whole["median_seconds"],
            "target_time_ratio": 1.0,
            "cpu_time_ratio_chunked_vs_whole": (
                chunked["median_cpu_seconds"] / whole["median_cpu_seconds"]
            ),
            "rss_ratio_chunked_vs_whole": chunked["peak_rss_mib"] / whole["peak_rss_mib"],
            "time_ratio_chunked_vs_plain": chunked["median_seconds"] / plain["median_seconds"],
            **report,
        },
    )


def hand_loop_step(model, batch: dict) -> None:
    """The baseline: what a researcher writes by hand for a masked token-mean PG loss."""
    import torch

    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_logp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    loss_mask = batch["response_mask"][:, 1:]
    loss = -(token_logp * batch["advantages"][:, 1:] * loss_mask).sum() / loss_mask.sum()
    loss.backward()


def _setup(comparison: str, args):
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if comparison == "a":
        return fixed_batch(args.a_rows, args.a_prompt, args.a_response, seed=1)
    if comparison == "b":
        return skewed_batch(args.b_rows, 16, 1024, seed=2)
    if comparison == "c":
        return grpo_batch(args.share_prompts, args.c_prompt, args.c_response, seed=3)
    return grpo_batch(args.share_prompts, args.d_prompt, args.d_response, seed=4)


def _runners(side: str, batch: dict) -> dict:
    """Zero-argument callables doing one op on ``batch`` on ``side``, by op name."""
    from arctic_platform.engine.config import ModelConfig, TrainingEngineConfig
    from arctic_platform.engine.models import load_causal_lm
    from arctic_platform.engine.trainer import TrainingEngine

    model_config = ModelConfig(name=MODEL)
    if side.startswith("loop"):
        model = load_causal_lm(model_config).train()
        return {"fwd_bwd": lambda: hand_loop_step(model, batch)}
    sharing = "off" if side == "unshared" else "auto"
    engine = TrainingEngine(
        TrainingEngineConfig(model=model_config, seed=0, prompt_sharing=sharing)
    )
    ops = {"fwd_bwd": lambda: engine.forward_backward(batch)}
    if side in ("shared", "unshared"):
        ops["fwd_no_grad"] = lambda: engine.forward(batch)
    return ops


def time_worker(comparison: str, args) -> dict:
    """Both sides of a comparison in this process, alternating; median seconds per side and op."""
    import torch

    batch = _setup(comparison, args)
    sides = COMPARISONS[comparison]
    runners = {side: _runners(side, batch) for side in sides}
    times = {(side, op): [] for side in sides for op in runners[side]}
    repeat = args.a_repeat if comparison == "a" else args.b_repeat
    for i in range(args.warmup + repeat):
        for side, op in times:
            start = time.perf_counter()
            runners[side][op]()
            if i >= args.warmup:
                times[side, op].append(time.perf_counter() - start)
    real = int(batch["attention_mask"].sum())
    out = {
        "rows": int(batch["input_ids"].shape[0]),
        "real_tokens": real,
        "padded_tokens": math.prod(batch["input_ids"].shape),
        "torch_threads": torch.get_num_threads(),
    }
    for (side, op), seconds in times.items():
        median = statistics.median(seconds)
        key = side if op == "fwd_bwd" else f"{side}_{op}"
        out[key] = {
            "median_seconds": median,
            "all_seconds": seconds,
            "tokens_per_second": real / median,
        }
    return out


def rss_worker(comparison: str, side: str, args) -> dict:
    """Peak RSS of one configuration alone: load it, run one fwd_bwd."""
    batch = _setup(comparison, args)
    _runners(side, batch)["fwd_bwd"]()
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_in_subprocess(worker: str, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.engine_train", "--worker", worker, *argv]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{worker} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--a-repeat", type=int, default=7, help="timed pairs for (a)")
    parser.add_argument("--b-repeat", type=int, default=3, help="timed pairs for (b)")
    parser.add_argument("--a-rows", type=int, default=4)
    parser.add_argument("--a-prompt", type=int, default=64)
    parser.add_argument("--a-response", type=int, default=192)
    parser.add_argument("--b-rows", type=int, default=4)
    parser.add_argument("--suite", choices=sorted(SUITES), default="default")
    parser.add_argument(
        "--share-prompts", type=int, default=1, help=f"prompts x {SAMPLES_PER_PROMPT} rows, (c)/(d)"
    )
    parser.add_argument("--c-prompt", type=int, default=512)
    parser.add_argument("--c-response", type=int, default=64)
    parser.add_argument("--d-prompt", type=int, default=64)
    parser.add_argument("--d-response", type=int, default=192)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per process (0: torch's default)"
    )
    parser.add_argument("--rv-layers", type=int, default=4, help="real_vocab model depth")
    parser.add_argument("--rv-hidden", type=int, default=1024, help="real_vocab model width")
    parser.add_argument("--rv-rows", type=int, default=8)
    parser.add_argument("--rv-prompt", type=int, default=128)
    parser.add_argument("--rv-response", type=int, default=256)
    parser.add_argument("--rv-steps", type=int, default=1, help="timed fwd_bwd + step per side")
    parser.add_argument("--rv-model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, comparison, *side = args.worker.split(":")
        if kind == "real_vocab":
            result = real_vocab_worker(comparison, args)
        elif kind == "time":
            result = time_worker(comparison, args)
        else:
            result = rss_worker(comparison, side[0], args)
        print(json.dumps(result))
        return

    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "rv_model")}
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    if args.suite == "real_vocab":
        real_vocab_suite(args, argv, settings)
        return
    report = {}
    for comparison in SUITES[args.suite]:
        fast, base = COMPARISONS[comparison]
        timing = run_in_subprocess(f"time:{comparison}", argv)
        for side in (fast, base):
            timing[side] |= run_in_subprocess(f"rss:{comparison}:{side}", argv)
        timing["ratio"] = timing[fast]["tokens_per_second"] / timing[base]["tokens_per_second"]
        if f"{fast}_fwd_no_grad" in timing:
            timing["ratio_fwd_no_grad"] = (
                timing[f"{fast}_fwd_no_grad"]["tokens_per_second"]
                / timing[f"{base}_fwd_no_grad"]["tokens_per_second"]
            )
        timing["padding_fraction"] = 1 - timing["real_tokens"] / timing["padded_tokens"]
        report[comparison] = timing

    from benchmarks._common import write_result

    if args.suite == "prompt_sharing":
        write_result(
            "engine_train_prompt_sharing",
            {
                "model": MODEL,
                "note": (
                    f"{args.share_prompts} prompt(s) x {SAMPLES_PER_PROMPT} samples; tokens/s "
                    "counts every row's real tokens (the shared prompt once per row, as the "
                    "unshared pass processes it); prompt_sharing auto vs off (today's path) "
                    "alternate in one process; peak RSS of one fwd_bwd per side in its own process"
                ),
                "settings": settings,
                "c_long_prompts": {
                    "ratio_fwd_bwd_shared_vs_unshared": report["c"].pop("ratio"),
                    "ratio_fwd_no_grad_shared_vs_unshared": report["c"].pop("ratio_fwd_no_grad"),
                    "target_fwd_bwd": 2.5,
                    **report["c"],
                },
                "d_short_prompts": {
                    "ratio_fwd_bwd_shared_vs_unshared": report["d"].pop("ratio"),
                    "ratio_fwd_no_grad_shared_vs_unshared": report["d"].pop("ratio_fwd_no_grad"),
                    "target_fwd_bwd": 0.95,
                    **report["d"],
                },
            },
        )
        return

    write_result(
        "engine_train",
        {
            "model": MODEL,
            "note": (
                "tokens/s counts real (non-padding) tokens; both sides of a comparison alternate "
                "in one process; peak RSS per configuration in its own process"
            ),
            "settings": settings,
            "a_overhead": {
                "ratio_engine_vs_hand_loop": report["a"].pop("ratio"),
                "target": 0.95,
                **report["a"],
            },
            "b_packing": {
                "ratio_packed_engine_vs_padded_loop": report["b"].pop("ratio"),
                "target": 1.5,
                **report["b"],
            },
        },
    )


if __name__ == "__main__":
    main()
