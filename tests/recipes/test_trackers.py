"""Experiment trackers: what each tracker's own reader finds equals ``metrics.jsonl``, resume
continues the same tracker runs with each step once, and a missing tracker package is a clear
error naming the extra."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from arctic_platform.cli import app
from arctic_platform.recipes import grpo
from arctic_platform.recipes.config import load_recipe
from arctic_platform.recipes.grpo import run_recipe
from arctic_platform.recipes.trackers import TRACKING_FILE, check_installed

pytestmark = pytest.mark.slow

TINY_RUN = [
    "sft.steps=6",
    "grpo.steps=4",
    "grpo.prompts_per_step=2",
    "grpo.samples_per_prompt=4",
    "eval.every=4",
    "eval.size=8",
    "checkpoint.every=4",
    "logging.plot_every=0",
]
TRACKERS = ["tensorboard", "wandb", "mlflow"]


@pytest.fixture(autouse=True)
def offline_trackers(monkeypatch):
    """wandb offline (its own env variable), MLflow on its default store, quiet wandb output."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)


def jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected_scalars(records: list[dict], *, timings: bool = True) -> dict[tuple[str, int], float]:
    """``{(tag, step): value}`` the trackers should hold: every number of every record, tagged
    ``<phase>/<key>`` (written out here, independently of the logger code)."""
    out = {}
    for record in records:
        for key, value in record.items():
            if key in ("step", "phase") or value is None or isinstance(value, bool):
                continue
            if not timings and (key.startswith("time_") or key == "tokens_per_s"):
                continue
            out[(f"{record['phase']}/{key}", record["step"])] = float(value)
    return out


def without_timings(scalars: dict[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    return {
        (tag, step): value
        for (tag, step), value in scalars.items()
        if not tag.split("/", 1)[1].startswith("time_") and not tag.endswith("/tokens_per_s")
    }


# -- the trackers' own readers ----------------------------------------------------------------


def read_tensorboard(run_dir: Path) -> tuple[dict[tuple[str, int], float], dict]:
    """Scalars via TensorBoard's EventAccumulator (which applies purge_step), and the config."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    scalars = {}
    for tag in accumulator.Tags()["scalars"]:
        steps = [event.step for event in accumulator.Scalars(tag)]
        assert len(steps) == len(set(steps)), f"{tag}: a step logged twice: {steps}"
        for event in accumulator.Scalars(tag):
            scalars[(tag, event.step)] = event.value
    text = accumulator.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    config = json.loads(text.removeprefix("```json\n").removesuffix("\n```"))
    return scalars, config


def wandb_records(run_dir: Path) -> list[list[dict]]:
    """The records of each offline wandb run file, oldest first, via ``wandb leet inspect``."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, "no offline wandb run"
    segments = []
    for path in files:
        shown = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert shown.returncode == 0, shown.stderr
        segments.append([json.loads(line) for line in shown.stdout.splitlines() if line.strip()])
    return segments


def read_wandb(run_dir: Path) -> tuple[dict[tuple[str, int], float], list[dict]]:
    """History scalars over all segments (each step at most once), and each segment's run record."""
    scalars: dict[tuple[str, int], float] = {}
    runs = []
    for records in wandb_records(run_dir):
        runs += [r["run"] for r in records if r["type"] == "run"]
        for record in records:
            if record["type"] != "history":
                continue
            item = record["history"]["item"]
            step = item["_step"]
            for tag, value in item.items():
                if tag.startswith("_"):
                    continue
                assert (tag, step) not in scalars, f"wandb holds step {step} of {tag} twice"
                scalars[(tag, step)] = value
    return scalars, runs


def read_mlflow(run_dir: Path) -> tuple[dict[tuple[str, int], float], object]:
    """Metric histories and the run, via MlflowClient on the file store the run wrote."""
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / TRACKING_FILE).read_text())["mlflow"]
    assert state["tracking_uri"] == (run_dir / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    run = client.get_run(state["run_id"])
    scalars = {}
    for tag in run.data.metrics:
        history = client.get_metric_history(run.info.run_id, tag)
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), f"{tag}: a step logged twice: {steps}"
        scalars.update({(tag, m.step): m.value for m in history})
    runs = client.search_runs([run.info.experiment_id])
    assert [r.info.run_id for r in runs] == [run.info.run_id]  # one run, resumed or not
    return scalars, run


def assert_same(actual: dict, expected: dict, *, rel: float = 0.0) -> None:
    assert set(actual) == set(expected)
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, rel=rel, abs=0.0), key


# -- tests ------------------------------------------------------------------------------------


def test_each_tracker_holds_each_step_of_metrics_jsonl_and_the_config(tmp_path):
    recipe = load_recipe(None, [*TINY_RUN, "logging.project=trackers-test"], loggers=TRACKERS)
    run_dir = tmp_path / "run"
    run_recipe(recipe, run_dir, show_progress=False)
    expected = expected_scalars(jsonl(run_dir))
    assert ("grpo/entropy", 9) in expected and ("sft/loss", 0) in expected

    scalars, config = read_tensorboard(run_dir)
    assert_same(scalars, expected, rel=1e-6)  # TensorBoard keeps float32
    assert config["grpo"]["steps"] == 4 and config["client"]["model"] == "builtin:tiny"

    scalars, runs = read_wandb(run_dir)
    assert_same(scalars, expected)
    (run,) = runs
    assert run["project"] == "trackers-test" and run["display_name"] == "run"
    assert run["config"]["update"]["grpo"]["steps"] == 4

    scalars, mlflow_run = read_mlflow(run_dir)
    assert_same(scalars, expected)
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "run"
    assert mlflow_run.data.params["grpo.steps"] == "4"
    assert mlflow_run.data.params["logging.backends"] == json.dumps(["jsonl", *TRACKERS])


def test_resume_continues_the_same_tracker_runs_with_each_step_once(tmp_path, monkeypatch):
    """Crash after step 8 (last checkpoint: step 7), resume: step 8 runs twice, is tracked once.
    MLflow joins at the resume and gets the earlier steps from metrics.jsonl."""
    run_dir = tmp_path / "run"
    original = grpo._Recipe.grpo_step

    def crash_at_step_9(self, step):
        if step == 9:
            raise KeyboardInterrupt("simulated crash")
        return original(self, step)

    monkeypatch.setattr(grpo._Recipe, "grpo_step", crash_at_step_9)
    first = load_recipe(None, TINY_RUN, loggers=["tensorboard", "wandb"])
    with pytest.raises(KeyboardInterrupt):
        run_recipe(first, run_dir, show_progress=False)
    before = json.loads((run_dir / TRACKING_FILE).read_text())
    assert before["wandb"]["last_step"] == 8
    assert json.loads((run_dir / "state.json").read_text())["step"] == 7
    crashed = {r["step"]: r for r in jsonl(run_dir)}
    assert max(crashed) == 8

    monkeypatch.setattr(grpo._Recipe, "grpo_step", original)
    resumed = load_recipe(None, TINY_RUN, loggers=TRACKERS)
    run_recipe(resumed, run_dir, resume=True, show_progress=False)
    after = json.loads((run_dir / TRACKING_FILE).read_text())
    assert after["wandb"]["run_id"] == before["wandb"]["run_id"]
    assert {name: after[name]["last_step"] for name in TRACKERS} == dict.fromkeys(TRACKERS, 9)
    records = jsonl(run_dir)
    assert [r["step"] for r in records] == list(range(10))
    expected = expected_scalars(records)

    # TensorBoard drops the crashed segment's step 8 (purge_step) and holds the resumed one.
    assert_same(read_tensorboard(run_dir)[0], expected, rel=1e-6)

    # wandb: two files of one run id; step 8 comes from the crashed segment, once.
    scalars, runs = read_wandb(run_dir)
    assert [r["run_id"] for r in runs] == [before["wandb"]["run_id"]] * 2
    assert_same(without_timings(scalars), expected_scalars(records, timings=False))
    assert scalars[("grpo/time_train_s", 8)] == crashed[8]["time_train_s"]
    assert scalars[("grpo/time_train_s", 9)] == records[9]["time_train_s"]

    # MLflow, new at the resume: steps 0-7 replayed from metrics.jsonl, then the live ones.
    scalars, run = read_mlflow(run_dir)
    assert_same(scalars, expected)
    assert run.info.status == "FINISHED"


def test_a_missing_tracker_package_is_an_error_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now raises ImportError
    with pytest.raises(
        ImportError, match=r"mlflow logger.*pip install 'arctic-platform\[tracking\]'"
    ):
        check_installed(["jsonl", "tensorboard", "mlflow"])
    recipe = load_recipe(None, TINY_RUN, loggers=["mlflow"])
    with pytest.raises(ImportError, match=r"arctic-platform\[tracking\]"):
        run_recipe(recipe, tmp_path / "run", show_progress=False)
    assert not (tmp_path / "run").exists()  # refused before anything started

    result = CliRunner().invoke(
        app, ["train", "--no-progress", "--output-dir", str(tmp_path / "cli"), "--logger", "mlflow"]
    )
    assert result.exit_code == 2
    assert "arctic-platform[tracking]" in result.output and "mlflow" in result.output


def test_logger_options_add_to_the_recipes_backends(tmp_path):
    recipe = load_recipe(None, ["logging.backends=[wandb]"], loggers=["tensorboard", "wandb"])
    assert recipe.logging.backends == ["jsonl", "wandb", "tensorboard"]
    assert load_recipe(None).logging.backends == ["jsonl"]

    result = CliRunner().invoke(
        app, ["train", "--no-progress", "--output-dir", str(tmp_path), "--logger", "comet"]
    )
    assert result.exit_code == 2
    assert "logging.backends" in result.output and "comet" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("client: {model: builtin:tiny}\nlogging: {backend: [wandb]}\n")
    result = CliRunner().invoke(app, ["train", "--no-progress", "--config", str(bad)])
    assert result.exit_code == 2 and "backend" in result.output


def test_the_plot_is_redrawn_during_the_run(tmp_path, monkeypatch):
    """With plot_every=2 the PNG is there (and current) while later steps still run."""
    drawn_with: list[int] = []
    original_plot, original_step = grpo.plot_run, grpo._Recipe.grpo_step

    def spy_plot(records, path, *, title):
        drawn_with.append(records[-1]["step"])
        return original_plot(records, path, title=title)

    def grpo_step_checking_the_plot(self, step):
        plot = tmp_path / "run" / "reward_curve.png"
        assert plot.exists() and drawn_with[-1] == step - 1 - (step % 2 == 1)
        return original_step(self, step)

    monkeypatch.setattr(grpo, "plot_run", spy_plot)
    monkeypatch.setattr(grpo._Recipe, "grpo_step", grpo_step_checking_the_plot)
    recipe = load_recipe(None, [*TINY_RUN, "logging.plot_every=2"])
    run_recipe(recipe, tmp_path / "run", show_progress=False)
    assert drawn_with == [1, 3, 5, 7, 9, 9]  # every second step, then at the end


def test_a_tracker_that_cannot_start_is_an_error_naming_it(tmp_path, monkeypatch):
    """wandb online without an API key refuses to start: the run stops with wandb's reason."""
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no saved login
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    import wandb

    wandb.teardown()  # wandb reads its environment once per process; earlier tests ran offline
    try:
        result = CliRunner().invoke(
            app,
            ["train", "--no-progress", "--output-dir", str(tmp_path / "run"), "--logger", "wandb"]
            + [f"--set={s}" for s in TINY_RUN],
        )
    finally:
        wandb.teardown()
    assert result.exit_code == 2, result.output
    assert "logging.backends: wandb could not open its run" in result.output
    assert "API key" in result.output
    assert not (tmp_path / "run" / "metrics.jsonl").read_text()  # no step ran


def test_the_config_names_exactly_the_trackers_there_are():
    from typing import get_args

    from arctic_platform.recipes.config import TrackerName
    from arctic_platform.recipes.trackers import TRACKERS

    assert set(get_args(TrackerName)) == {"jsonl", *TRACKERS}
