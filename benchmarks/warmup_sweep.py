"""How the default recipe's supervised warm-up ends under small changes of its settings and of
the float rounding.

Each setting runs the default recipe's warm-up alone (``grpo.steps=1``, no intermediate
evaluations or checkpoints) in its own process, ``--jobs`` at a time on one thread each, and
reports the held-out greedy reward when GRPO would start and the mean loss of the last ten
warm-up steps. Each runs with this CPU's own kernels or with AVX2 kernels forced (torch's,
oneDNN's and MKL's): on an AVX-512 machine those round differently, as another machine would.
This is a sensitivity measure, not a speed one: the README's caveat on the warm-up quotes it.
Run: ``python -m benchmarks.warmup_sweep [--jobs 2]``; writes
``benchmarks/results/warmup_sweep.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from benchmarks._common import write_result

FIXED = ["grpo.steps=1", "eval.every=0", "checkpoint.every=0", "logging.plot_every=0"]
# Kernels a run may use: this CPU's own, or AVX2 forced (what an AVX2-only machine runs).
KERNELS = {
    "native": {},
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}
SETTINGS = [
    # The default (1,500 steps at 2.2e-3) and the former one (900 steps), with either kernels.
    ([], "native"),
    ([], "avx2"),
    (["sft.steps=900"], "native"),
    (["sft.steps=900"], "avx2"),
    # The default's steps at peak rates around its 2.2e-3.
    (["sft.learning_rate=2e-3"], "native"),
    (["sft.learning_rate=2e-3"], "avx2"),
    (["sft.learning_rate=2.4e-3"], "native"),
    (["sft.learning_rate=2.4e-3"], "avx2"),
]
# Runs in a child so each setting gets a fresh process (one thread, its own model cache use).
CHILD = """
import json, sys, time
from pathlib import Path
from arctic_platform.recipes.config import load_recipe
from arctic_platform.recipes.grpo import run_recipe
out, overrides = Path(sys.argv[1]), json.loads(sys.argv[2])
started = time.perf_counter()
summary = run_recipe(load_recipe(None, overrides), out, show_progress=False)
losses = [r["loss"] for r in summary.records if r.get("phase") == "sft"]
print(json.dumps({
    "held_out_after_warm_up": summary.eval_rewards("sft")[-1],
    "loss_last_10": sum(losses[-10:]) / 10,
    "seconds": round(time.perf_counter() - started),
}))
"""


def run(setting: tuple[list[str], str], root: str, index: int) -> dict:
    overrides, kernels = setting
    env = {**os.environ, "OMP_NUM_THREADS": "1", **KERNELS[kernels]}
    command = [sys.executable, "-c", CHILD, f"{root}/{index}", json.dumps([*FIXED, *overrides])]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"overrides": overrides, "kernels": kernels, **result}


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 (else ``native`` and ``avx2`` runs use the same kernels)."""
    with open("/proc/cpuinfo") as info:
        return " avx512f" in info.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root, ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(run, SETTINGS, [root] * len(SETTINGS), range(len(SETTINGS))))
    write_result("warmup_sweep", {"fixed": FIXED, "cpu_has_avx512": has_avx512(), "runs": runs})


if __name__ == "__main__":
    main()
