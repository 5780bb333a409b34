"""The main job end to end: identical metrics across backends, resume, CLI errors (that it
learns: ``test_learning.py``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from arctic_platform.client.local_server import LocalServer
from arctic_platform.recipes import grpo
from arctic_platform.recipes.config import load_recipe
from arctic_platform.recipes.grpo import run_recipe
from arctic_platform.recipes.launch import backend_settings

pytestmark = pytest.mark.slow

TIMING_KEYS = {"tokens_per_s"}


def comparable(records: list[dict]) -> list[dict]:
    """Metrics without wall-clock fields (timings differ between runs, nothing else may)."""
    return [
        {k: v for k, v in r.items() if k not in TIMING_KEYS and not k.startswith("time_")}
        for r in records
    ]


SHORT = [
    "sft.steps=12",
    "grpo.steps=4",
    "grpo.prompts_per_step=4",
    "eval.every=8",
    "eval.size=20",
    "checkpoint.every=8",
]


def test_http_and_cortex_give_the_same_metrics_as_inprocess(tmp_path):
    reference = run_recipe(load_recipe(None, SHORT), tmp_path / "inprocess", show_progress=False)
    with LocalServer(data_dir=tmp_path / "server", device="cpu") as url:
        for backend in ("http", "cortex"):
            recipe = load_recipe(None, SHORT, backend_settings(backend, url))
            summary = run_recipe(recipe, tmp_path / backend, show_progress=False)
            assert comparable(summary.records) == comparable(reference.records), backend


def test_resume_after_a_crash_continues_with_identical_metrics(tmp_path, monkeypatch):
    recipe = load_recipe(None, SHORT)
    uninterrupted = run_recipe(recipe, tmp_path / "whole", show_progress=False)
    original = grpo._Recipe.grpo_step

    def crash_at_step_14(self, step):
        if step == 14:
            raise KeyboardInterrupt("simulated crash")
        return original(self, step)

    monkeypatch.setattr(grpo._Recipe, "grpo_step", crash_at_step_14)
    with pytest.raises(KeyboardInterrupt):
        run_recipe(recipe, tmp_path / "crashed", show_progress=False)
    state = json.loads((tmp_path / "crashed" / "state.json").read_text())
    assert state["step"] == 7  # the last checkpoint before the crash
    monkeypatch.setattr(grpo._Recipe, "grpo_step", original)
    resumed = run_recipe(recipe, tmp_path / "crashed", resume=True, show_progress=False)
    assert comparable(resumed.records) == comparable(uninterrupted.records)


def test_one_update_is_on_policy_and_several_use_old_logprobs(tmp_path):
    """One update per batch: the ratio is taken against the current policy (KL exactly 0, no
    log-prob pass). Two: the second update's ratio is against the log-probs from before the
    first, so its KL is not 0."""
    short = [s for s in SHORT if not s.startswith(("eval", "checkpoint"))] + ["sft.steps=2"]
    one = run_recipe(load_recipe(None, short), tmp_path / "one", show_progress=False)
    grpo_records = [r for r in one.records if r["phase"] == "grpo"]
    assert all(r["kl"] == 0.0 for r in grpo_records)
    two = load_recipe(None, [*short, "grpo.updates_per_batch=2"])
    records = run_recipe(two, tmp_path / "two", show_progress=False).records
    assert all(r["kl"] != 0.0 for r in records if r["phase"] == "grpo")


def test_each_phase_steps_with_its_scheduled_learning_rate(tmp_path):
    """The warm-up's rate falls by a cosine from ``learning_rate`` to ``min_lr_ratio`` of it, as
    the optimizer reports it back; a constant schedule keeps it."""
    short = ["sft.steps=4", "grpo.steps=2", "grpo.prompts_per_step=2", "eval.every=0"]
    decayed = load_recipe(None, [*short, "sft.learning_rate=2e-3", "sft.min_lr_ratio=0.25"])
    records = run_recipe(decayed, tmp_path / "cosine", show_progress=False).records
    expected = [2e-3 * (0.25 + 0.75 * 0.5 * (1 + math.cos(math.pi * i / 4))) for i in range(4)]
    assert [r["lr"] for r in records if r["phase"] == "sft"] == pytest.approx(expected)
    constant = load_recipe(None, [*short, "sft.lr_schedule=constant", "grpo.steps=0"])
    records = run_recipe(constant, tmp_path / "constant", show_progress=False).records
    assert [r["lr"] for r in records] == pytest.approx([constant.sft.learning_rate] * 4)


def run_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "arctic_platform.cli", "train", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )


def test_the_cli_runs_a_recipe_and_reports_where_its_files_are(tmp_path):
    out = tmp_path / "cli-run"
    result = run_cli("--output-dir", str(out), *[f"--set={s}" for s in SHORT], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "metrics:" in result.stdout and str(out) in result.stdout.replace("\n", "")
    assert (out / "metrics.jsonl").exists() and (out / "reward_curve.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "grpo.stepz=3"], "stepz"),
        (["--set", "grpo.steps=-1"], "grpo.steps"),
        (["--set", "nonsense"], "expected key.path=value"),
        (["--set", "client.backend.type=carrier-pigeon"], "carrier-pigeon"),
        (["--backend", "telnet"], "--backend: unknown backend 'telnet'"),
        (["--backend", "inprocess", "--url", "http://x"], "--url"),
        (["--config", "missing.yaml"], "does not exist"),
        (["--resume"], "--resume"),
        # Task options are the task's constructor's: checked before an engine starts (they
        # failed with a TypeError traceback once the engines ran).
        (["--set", "task.foo=1"], "task.foo: not an option of the addition task"),
        (["--set", "task.max_operand=abc"], "task.max_operand"),
        (["--set", "task.max_operand=30000"], "task.max_operand: must be in 1..9999"),
        (["--backend", "http", "--url", "http://127.0.0.1:abc"], "not a valid URL"),
        # Checked with the recipe, not at the first GRPO step after the whole warm-up.
        (["--set", "grpo.kl_loss_type=bogus"], "unknown kl type 'bogus'"),
        (["--set", "grpo.learning_rate=.inf"], "grpo.learning_rate"),
        (["--set", "grpo.entropy_coeff=.nan"], "grpo.entropy_coeff"),
    ],
)
def test_bad_options_give_errors_naming_the_field(tmp_path, args, message):
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in " ".join((result.stdout + result.stderr).split())
    assert "Traceback" not in result.stdout + result.stderr
    assert not list(tmp_path.glob("runs/*/engine-data"))  # nothing was started


def test_a_yaml_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    """Nine anchors, each nine references to the one before: 557 bytes that stand for 9**9
    values, which writing the run's recipe.json expanded until the process died (8 GiB)."""
    lines = ["sft: {steps: 1}", "task:", "  name: addition", "  a0: &a0 [x,x,x,x,x,x,x,x,x]"]
    lines += [f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    result = run_cli("--config", str(bomb), cwd=tmp_path)
    assert result.returncode == 2
    assert "values once its aliases are expanded" in " ".join(result.stdout.split())
    flow = "&a [" + ",".join(["x"] * 9) + "]"
    result = run_cli("--set", f"task.x=[{flow}, " + ", ".join(["*a"] * 20000) + "]", cwd=tmp_path)
    assert result.returncode == 2 and "--set task.x" in result.stdout


def test_a_client_or_file_error_during_a_run_is_an_error_line_not_a_traceback(tmp_path):
    unreachable = run_cli("--backend", "http", "--url", "http://127.0.0.1:9", cwd=tmp_path)
    (tmp_path / "a-file").write_text("")
    unwritable = run_cli("--output-dir", str(tmp_path / "a-file" / "run"), cwd=tmp_path)
    for result, says in ((unreachable, "cannot connect"), (unwritable, "Not a directory")):
        assert result.returncode == 1, result.stdout + result.stderr
        assert says in result.stdout and "Traceback" not in result.stdout + result.stderr


def test_bad_recipe_yaml_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("client: {model: builtin:tiny}\nsft: {steps: 1, batchsize: 4}\n")
    result = run_cli("--config", str(bad), cwd=tmp_path)
    assert result.returncode == 2 and "batchsize" in result.stdout
    bad.write_text("client: [not, a, mapping]\n")
    result = run_cli("--config", str(bad), cwd=tmp_path)
    assert result.returncode == 2 and "client" in result.stdout


@pytest.mark.parametrize(
    "state",
    ["not json", "[1, 2]", "{}", '{"step": "x"}', '{"step": 1, "extra": true}', None],
    ids=["not json", "a list", "empty", "a bad step", "a foreign key", "a folder"],
)
def test_resume_from_a_state_this_recipe_did_not_write_names_the_file(tmp_path, state):
    """``--resume`` read ``state.json`` as it was (KeyError and TypeError tracebacks), after
    overwriting the run's ``recipe.json``; now it is a 2 naming the file, and nothing is written."""
    run = tmp_path / "run"
    run.mkdir()
    if state is None:
        (run / "state.json").mkdir()
    else:
        (run / "state.json").write_text(state)
    result = run_cli("--resume", "--output-dir", str(run), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "state.json" in "".join(result.stdout.split())  # rich wraps the path
    assert "Traceback" not in result.stdout + result.stderr
    assert sorted(p.name for p in run.iterdir()) == ["state.json"]
