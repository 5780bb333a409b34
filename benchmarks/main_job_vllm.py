"""The main job with the vLLM sampler against the default engine, on CPU: README's command.

Runs ``arctic-platform train`` (the default recipe) once per engine, one after the other, each in
its own process: ``--set sampling.engine=vllm`` and nothing else for vLLM (its memory sized from
the job, weights synced by ``reload``, what ``auto`` is on CPU), the recipe as it is for ours.
Reported per engine from the run's ``metrics.jsonl``: the median GRPO step (generate, log-probs,
train, weight sync: the step's own timers) and its parts, the held-out reward after the SFT
warm-up and at the end, and the run's wall time; plus the vLLM step's ratio to ours (target
<= 1.3) and the load average around each run (other work on the machine distorts the times).

Needs ``$ARCTIC_VLLM_PYTHON`` (README, 'vLLM sampling engine'). Run:
``python -m benchmarks.main_job_vllm [--grpo-steps 200] [--sft-steps N]``; writes
``benchmarks/results/main_job_vllm.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import write_result

ENGINES = {"torch": [], "vllm": ["sampling.engine=vllm"]}
STEP_PARTS = ("time_generate_s", "time_logprobs_s", "time_train_s", "time_sync_s")


def run(engine: str, grpo_steps: int, sft_steps: int | None, out: Path) -> dict:
    overrides = [*ENGINES[engine], f"grpo.steps={grpo_steps}", "checkpoint.every=0"]
    if sft_steps is not None:
        overrides.append(f"sft.steps={sft_steps}")
    command = [sys.executable, "-m", "arctic_platform.cli", "train", "--no-progress"]
    command += ["--output-dir", str(out)]
    for override in overrides:
        command += ["--set", override]
    load_before = os.getloadavg()
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in records if r.get("phase") == "grpo"]
    evals = {
        phase: [r["eval_reward"] for r in records if r.get("phase") == phase and "eval_reward" in r]
        for phase in ("sft", "grpo")
    }
    return {
        "overrides": overrides,
        "grpo_steps": len(grpo),
        "median_step_s": statistics.median(sum(r[p] for p in STEP_PARTS) for r in grpo),
        "median_parts_s": {p: statistics.median(r[p] for r in grpo) for p in STEP_PARTS},
        "held_out_after_sft": evals["sft"][-1] if evals["sft"] else None,
        "held_out_final": evals["grpo"][-1] if evals["grpo"] else None,
        "wall_s": wall,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpo-steps", type=int, default=200)
    parser.add_argument("--sft-steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="main-job-vllm-") as tmp:
        for engine in args.engines:
            results[engine] = run(engine, args.grpo_steps, args.sft_steps, Path(tmp) / engine)
    result = {"engines": results}
    if {"torch", "vllm"} <= results.keys():
        ours, vllm = results["torch"]["median_step_s"], results["vllm"]["median_step_s"]
        result["vllm_step_vs_torch"] = vllm / ours
    write_result("main_job_vllm", result)


if __name__ == "__main__":
    main()
