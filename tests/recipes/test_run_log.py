"""The run's picture: reward on top; SFT loss, GRPO loss, KL and entropy each on its own axis."""

from __future__ import annotations

import pytest

from arctic_platform.recipes.run_log import plot_run, run_figure

RECORDS = [
    {"step": 0, "phase": "sft", "loss": 4.5},
    {"step": 1, "phase": "sft", "loss": 3.0, "eval_reward": 0.25},
    {"step": 2, "phase": "grpo", "loss": 0.01, "kl": 1e-4, "entropy": 2.5, "reward_mean": 0.5},
    {
        "step": 3,
        "phase": "grpo",
        "loss": -0.02,
        "kl": 3e-4,
        "kl_loss": 0.002,
        "entropy": 2.0,
        "reward_mean": 0.75,
        "eval_reward": 0.5,
    },
]


def lines_by_panel(figure) -> dict[str, list[tuple[list, list]]]:
    return {
        axis.get_title(): [(list(line.get_xdata()), list(line.get_ydata())) for line in axis.lines]
        for axis in figure.axes[1:]
    }


def test_each_loss_metric_has_its_own_axis():
    figure = run_figure(RECORDS, title="t")
    panels = lines_by_panel(figure)
    assert panels["SFT loss"] == [([0, 1], [4.5, 3.0])]
    assert panels["GRPO loss"] == [([2, 3], [0.01, -0.02])]
    assert panels["GRPO KL"] == [([2, 3], [1e-4, 3e-4]), ([3], [0.002])]
    assert panels["GRPO entropy"] == [([2, 3], [2.5, 2.0])]
    reward = figure.axes[0]
    assert [list(line.get_ydata()) for line in reward.lines if line.get_label()[0] != "_"] == [
        [0.5, 0.75],
        [0.25, 0.5],
    ]
    # Different axes keep their own scales: the GRPO loss is not squashed by the SFT loss.
    grpo_low, grpo_high = figure.axes[2].get_ylim()
    assert grpo_high - grpo_low < 0.1


def test_an_sft_only_run_draws_empty_grpo_panels(tmp_path):
    path = plot_run(RECORDS[:2], tmp_path / "reward_curve.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*partial*"))  # the temporary file was moved into place
    figure = run_figure(RECORDS[:2], title="t")
    assert lines_by_panel(figure)["GRPO loss"] == []
    texts = [t.get_text() for t in figure.axes[2].texts]
    assert texts == ["no data yet"]


@pytest.mark.parametrize("records", [[], RECORDS[:1]])
def test_a_plot_of_a_run_that_just_started(tmp_path, records):
    assert plot_run(records, tmp_path / "p.png", title="t").stat().st_size > 0


def test_a_kl_that_is_zero_by_construction_says_so():
    """One update per batch: the old-vs-new KL is exactly 0 every step; the panel says why."""
    on_policy = [dict(r, kl=0.0) for r in RECORDS if r["phase"] == "grpo"]
    for r in on_policy:
        r.pop("kl_loss", None)
    texts = [t.get_text() for t in run_figure(on_policy, title="t").axes[3].texts]
    assert len(texts) == 1 and "by construction" in texts[0]
    assert not run_figure(RECORDS, title="t").axes[3].texts  # a moving KL gets no note
