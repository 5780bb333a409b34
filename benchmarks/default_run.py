"""The default run as a newcomer starts it (``arctic-platform train``), measured: README's table.

Runs the CLI with no arguments in a child process (its own threads, its own memory) and reports
the held-out greedy reward when GRPO starts, after 100 and 200 GRPO steps, the GRPO sample reward
of the first and last ten steps, and the child's CPU time, wall time and peak RSS. It is an
outcome measure, not a speed ratio: the warm-up's end is a draw of the float rounding (see
``benchmarks/warmup_sweep.py``), so one run's figures say what this machine gave once.
Run: ``python -m benchmarks.default_run``; writes ``benchmarks/results/default_run.json`` and the
run's reward plot to ``docs/default-run.png`` (README's picture of this run).
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

from benchmarks._common import write_result

PLOT = Path(__file__).resolve().parent.parent / "docs" / "default-run.png"
CLI = "import sys; from arctic_platform.cli import main; sys.argv[0] = 'arctic-platform'; main()"


def figures(records: list[dict]) -> dict:
    """What README's table shows, from a run's ``metrics.jsonl`` records."""
    sft_end = max(r["step"] for r in records if r["phase"] == "sft")
    held_out = {r["step"]: r["eval_reward"] for r in records if "eval_reward" in r}
    sample = [r["reward_mean"] for r in records if r["phase"] == "grpo"]
    return {
        "held_out_when_grpo_starts": held_out[sft_end],
        "held_out_after_100_grpo_steps": held_out[sft_end + 100],
        "held_out_after_200_grpo_steps": held_out[sft_end + 200],
        "lowest_held_out_during_grpo": min(v for s, v in held_out.items() if s > sft_end),
        "sample_reward_first_10": mean(sample[:10]),
        "sample_reward_last_10": mean(sample[-10:]),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        command = [sys.executable, "-c", CLI, "train", "--output-dir", out]
        subprocess.run(command, check=True, capture_output=True)
        wall = time.perf_counter() - started
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        shutil.copyfile(Path(out) / "reward_curve.png", PLOT)
    write_result(
        "default_run",
        {
            "command": "arctic-platform train",
            **figures(records),
            "cpu_seconds": round(usage.ru_utime + usage.ru_stime),
            "wall_seconds": round(wall),
            "peak_rss_mib": round(usage.ru_maxrss / 1024),
        },
    )


if __name__ == "__main__":
    main()
