"""What a run leaves behind: ``metrics.jsonl``, a reward/loss plot, and the live progress bar.

``metrics.jsonl`` has one JSON object per step; a resumed run truncates it to the step it resumes
from and appends, so the file always describes one consistent run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward_curve.png"


class MetricsLog:
    """Appends one record per step to ``<run_dir>/metrics.jsonl``."""

    def __init__(self, run_dir: Path, *, resume_after: int | None = None) -> None:
        self.path = run_dir / METRICS_FILE
        self.records: list[dict[str, Any]] = []
        if resume_after is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                record = json.loads(line)
                if record["step"] <= resume_after:
                    self.records.append(record)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")


def plot_run(records: list[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Reward (training mean and greedy eval) and loss against step, SFT/GRPO boundary marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    grpo = [r for r in records if r["phase"] == "grpo"]
    evals = [r for r in records if r.get("eval_reward") is not None]
    if grpo:
        top.plot(
            [r["step"] for r in grpo],
            [r["reward_mean"] for r in grpo],
            label="GRPO sample reward (mean)",
            alpha=0.6,
        )
    top.plot(
        [r["step"] for r in evals],
        [r["eval_reward"] for r in evals],
        "o-",
        label="held-out reward (greedy)",
        color="tab:red",
    )
    top.set_ylabel("reward")
    top.set_ylim(-0.02, 1.02)
    top.legend(loc="upper left")
    top.set_title(title)
    for phase, color in (("sft", "tab:gray"), ("grpo", "tab:blue")):
        points = [r for r in records if r["phase"] == phase and r.get("loss") is not None]
        bottom.plot(
            [r["step"] for r in points],
            [r["loss"] for r in points],
            color=color,
            label=f"{phase.upper()} loss",
        )
    bottom.set_xlabel("step")
    bottom.set_ylabel("loss")
    bottom.legend(loc="upper right")
    if grpo:
        for axis in (top, bottom):
            axis.axvline(grpo[0]["step"] - 0.5, color="k", linestyle=":", linewidth=1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class Progress:
    """A rich progress bar showing step, phase, reward, loss, KL, tokens/s and ETA."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]{task.fields[phase]:>4}"),
            BarColumn(bar_width=16),
            MofNCompleteColumn(),
            TextColumn(
                "reward {task.fields[reward]} eval {task.fields[eval]} loss {task.fields[loss]}"
                " kl {task.fields[kl]} {task.fields[tps]} tok/s"
            ),
            TextColumn("ETA"),
            TimeRemainingColumn(compact=True),
        )
        self._task = self._bar.add_task(
            "train", total=total, phase="", reward="-", eval="-", loss="-", kl="-", tps="-"
        )

    def __enter__(self) -> Progress:
        if self.enabled:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._bar.__exit__(*exc)

    def update(self, record: dict[str, Any], completed: int, last_eval: float | None) -> None:
        if not self.enabled:
            return

        def fmt(value: Any) -> str:
            return "-" if value is None else f"{value:.2f}"

        self._bar.update(
            self._task,
            completed=completed,
            phase=record["phase"].upper(),
            reward=fmt(record.get("reward_mean")),
            eval=fmt(last_eval),
            loss=fmt(record.get("loss")),
            kl=fmt(record.get("kl")),
            tps=f"{record.get('tokens_per_s', 0):,.0f}",
        )
