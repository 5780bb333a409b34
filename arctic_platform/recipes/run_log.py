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


# The panels under the reward plot: title, the (phase, metric, label) series drawn on it, and what
# a panel whose every value is exactly 0 means (None: nothing to say). With one update per batch
# the loss takes its ratio against the current policy, so the old-vs-new KL is 0 by construction;
# the note keeps a flat line from reading as a broken metric.
LOSS_PANELS = (
    ("SFT loss", (("sft", "loss", "cross-entropy"),), None),
    ("GRPO loss", (("grpo", "loss", "policy loss"),), None),
    (
        "GRPO KL",
        (("grpo", "kl", "old vs new policy"), ("grpo", "kl_loss", "vs reference")),
        "0 by construction: one update per batch\n(the ratio is against the current policy)",
    ),
    ("GRPO entropy", (("grpo", "entropy", "token entropy"),), None),
)


def run_figure(records: list[dict[str, Any]], *, title: str):
    """The run's picture: reward on top, then the SFT loss, GRPO loss, KL and entropy each on its
    own axis (their scales differ by orders of magnitude)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(10, 9))
    grid = fig.add_gridspec(3, 2)
    top = fig.add_subplot(grid[0, :])
    grpo = [r for r in records if r["phase"] == "grpo"]
    evals = [r for r in records if r.get("eval_reward") is not None]
    if grpo:
        top.plot(
            [r["step"] for r in grpo],
            [r["reward_mean"] for r in grpo],
            label="GRPO sample reward (mean)",
            alpha=0.6,
        )
        top.axvline(grpo[0]["step"] - 0.5, color="k", linestyle=":", linewidth=1)
    top.plot(
        [r["step"] for r in evals],
        [r["eval_reward"] for r in evals],
        "o-",
        label="held-out reward (greedy)",
        color="tab:red",
    )
    top.set(xlabel="step", ylabel="reward", ylim=(-0.02, 1.02), title=title)
    top.legend(loc="upper left")
    for index, (panel, series, zero_note) in enumerate(LOSS_PANELS):
        axis = fig.add_subplot(grid[1 + index // 2, index % 2])
        values: list[float] = []
        for phase, key, label in series:
            points = [r for r in records if r["phase"] == phase and r.get(key) is not None]
            if points:
                axis.plot([r["step"] for r in points], [r[key] for r in points], label=label)
                values += [r[key] for r in points]
        if values and len(series) > 1:
            axis.legend(loc="upper right", fontsize=8)
        note = "no data yet" if not values else None
        if values and zero_note and not any(values):
            note = zero_note
        if note:  # above a drawn (flat) line, centred on an empty axis
            height = 0.75 if values else 0.5
            axis.text(0.5, height, note, ha="center", va="center", transform=axis.transAxes)
        axis.set_title(panel, fontsize=10)
        axis.set_xlabel("step")
    fig.tight_layout()
    return fig


def plot_run(records: list[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Write :func:`run_figure` to ``path``. Redrawn during the run: the PNG is written beside
    ``path`` and moved over it, so a viewer never reads a half-written file."""
    import matplotlib.pyplot as plt

    fig = run_figure(records, title=title)
    partial = path.with_name(f".{path.stem}.partial{path.suffix}")
    fig.savefig(partial, dpi=100)
    plt.close(fig)
    partial.replace(path)
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
