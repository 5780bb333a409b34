"""The recipe's configuration: YAML mapped onto typed sections, overridable from the CLI.

A recipe file has a ``task`` (what to learn), a ``client`` (the :class:`ArcticRLClientConfig`:
model, backend, job settings), the ``sft`` warm-up and ``grpo`` phases, ``eval``,
``checkpoint`` and ``logging`` (experiment trackers) settings. Every section forbids unknown
keys, so a typo in the YAML or in a ``--set key=value`` override is an error that names the
field. The packaged default recipe
(``default.yaml``) is what ``arctic-platform train`` runs with no arguments.
"""

from __future__ import annotations

import copy
import math
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
)

from arctic_platform.client.config import ArcticRLClientConfig
from arctic_platform.client.yaml_files import check_size, load_mapping


class _Section(BaseModel):
    # Infinite or NaN numbers pass "positive" and "at least" checks but fail the run's first
    # step that uses them (after the whole warm-up): refused here instead.
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


class TaskSettings(BaseModel):
    """``name`` picks the task; the other keys are that task's options."""

    model_config = ConfigDict(extra="allow")

    name: Literal["addition", "gsm8k"] = "addition"
    chat_template: bool = False

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class _ScheduledPhase(_Section):
    """A phase whose learning rate follows ``lr_schedule`` over its ``steps``: ``constant``, or
    ``cosine`` from ``learning_rate`` down to ``min_lr_ratio`` of it (passed to each ``step``).

    A decaying rate lets a phase settle. The step at which the warm-up's loss breaks through its
    plateau near 0.8 still moves with the float rounding (any change to the arithmetic, to the
    memory layout a BLAS call meets, or to the CPU's vector width), so its defaults are chosen
    for margin, not for one run: over 900 steps at 2.2e-3 the warm-up ended at 0.57 held-out on
    one machine and at 0.255 on an AVX-512 one (0.78 there with AVX2 kernels forced); over the
    default 1,500 steps it ended at 0.555 to 1.0 for peak rates of 2e-3 to 2.4e-3 and at 0.855
    to 0.95 at 2.2e-3 with either kernel width (`benchmarks/results/warmup_sweep.json`).
    GRPO's first updates lower held-out accuracy before they raise it; its default rate, 2e-4,
    keeps that dip smaller (at 5e-4 one run fell from 0.83 to 0.61 in 30 steps)."""

    def learning_rate_at(self, step_in_phase: int) -> float:
        if self.lr_schedule == "constant":
            return self.learning_rate
        progress = step_in_phase / self.steps  # < 1: the last step still learns
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.learning_rate * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    steps: NonNegativeInt
    learning_rate: PositiveFloat
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)


class SftPhase(_ScheduledPhase):
    """Supervised warm-up on the task's reference completions (``cross_entropy`` loss)."""

    steps: NonNegativeInt = 1500
    batch_size: PositiveInt = 64
    learning_rate: PositiveFloat = 2.2e-3


class GrpoPhase(_ScheduledPhase):
    """GRPO: ``prompts_per_step`` prompts x ``samples_per_prompt`` samples per step.

    The loss is ``verl_grpo`` with these knobs in ``meta.actor_config``; advantages are
    group-normalised rewards. ``updates_per_batch`` optimizer steps are taken on each batch (PPO
    epochs); with one, the loss's ratio is taken against the current policy and no separate
    log-prob pass runs.
    """

    steps: NonNegativeInt = 200
    prompts_per_step: PositiveInt = 32
    samples_per_prompt: int = Field(8, ge=2)
    learning_rate: PositiveFloat = 2e-4
    temperature: PositiveFloat = 1.0
    max_tokens: PositiveInt = 5
    clip_ratio: PositiveFloat = 0.2
    loss_agg_mode: Literal[
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ] = "token-mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0.0)
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    norm_adv_by_std: bool = True
    updates_per_batch: PositiveInt = 1

    @field_validator("kl_loss_type")
    @classmethod
    def _known_kl_type(cls, value: str) -> str:
        """The engine's own check (its KL estimators), now rather than at the first GRPO step."""
        from arctic_platform.engine.losses.kl import check_kl_type

        return check_kl_type("kl_loss_type", value)  # a ValueError pydantic reports


class EvalSettings(_Section):
    """Greedy evaluation on the task's held-out set every ``every`` steps (0 = only at ends)."""

    every: NonNegativeInt = 25
    max_tokens: PositiveInt = 5
    size: PositiveInt | None = None


class CheckpointSettings(_Section):
    """Save a resumable checkpoint every ``every`` steps (0 = only at the end)."""

    every: NonNegativeInt = 100
    keep: PositiveInt = 2


# Where per-step metrics can go; ``jsonl`` (``metrics.jsonl``) is always written.
TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


class LoggingSettings(_Section):
    """Experiment trackers that receive each step's metrics and the recipe config.

    ``metrics.jsonl`` is always written (resume and the plot read it), so ``jsonl`` is in
    ``backends`` whether listed or not. ``project`` is the wandb project and the MLflow
    experiment (default: the recipe's name); ``run_name`` is the run's display name (default: the
    run directory's name). ``reward_curve.png`` is redrawn every ``plot_every`` steps (0: only at
    the end of the run).
    """

    backends: list[TrackerName] = ["jsonl"]
    project: str | None = Field(None, min_length=1)
    run_name: str | None = Field(None, min_length=1)
    plot_every: NonNegativeInt = 50

    @field_validator("backends")
    @classmethod
    def _jsonl_first_no_repeats(cls, backends: list[str]) -> list[str]:
        return list(dict.fromkeys(["jsonl", *backends]))


class RecipeConfig(_Section):
    """A whole recipe (see the module docstring)."""

    name: str = "addition-grpo"
    seed: int = 0
    task: TaskSettings = TaskSettings()
    client: ArcticRLClientConfig
    sft: SftPhase = SftPhase()
    grpo: GrpoPhase = GrpoPhase()
    eval: EvalSettings = EvalSettings()
    checkpoint: CheckpointSettings = CheckpointSettings()
    logging: LoggingSettings = LoggingSettings()

    @property
    def total_steps(self) -> int:
        return self.sft.steps + self.grpo.steps


def default_recipe_path() -> Path:
    return Path(str(resources.files("arctic_platform.recipes") / "default.yaml"))


def load_recipe(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    backend: dict[str, Any] | None = None,
    loggers: list[str] | None = None,
) -> RecipeConfig:
    """The recipe at ``path`` (default: the packaged one) with ``key.sub=value`` overrides and,
    when given, ``backend`` replacing the client's backend section and ``loggers`` added to
    ``logging.backends``."""
    data = load_mapping(path if path is not None else default_recipe_path())
    for override in overrides or []:
        data = apply_override(data, override)
    if backend is not None:
        client = data.get("client")
        data["client"] = {**(client if isinstance(client, dict) else {}), "backend": backend}
    if loggers:
        section = data.get("logging")
        section = dict(section) if isinstance(section, dict) else {}
        listed = section.get("backends", [])
        if isinstance(listed, list):  # anything else is left for validation to name
            section["backends"] = [*listed, *loggers]
        data["logging"] = section
    return RecipeConfig.model_validate(data)


# The client's job sections, which ``--set`` also reaches without the ``client.`` prefix.
CLIENT_JOB_SECTIONS = ("training", "sampling", "log_prob")


def apply_override(data: dict, override: str) -> dict:
    """``grpo.steps=20`` -> ``data["grpo"]["steps"] = 20`` (the value parsed as YAML).

    The client's job sections may be named directly: ``sampling.engine=vllm`` is
    ``client.sampling.engine=vllm``.
    """
    import yaml

    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {override!r}: expected key.path=value")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ValueError(f"--set {override!r}: value is not valid YAML: {exc}") from None
    check_size(value, f"--set {key.strip()}")
    data = copy.deepcopy(data)
    node = data
    parts = key.strip().split(".")
    if len(parts) > 1 and parts[0] in CLIENT_JOB_SECTIONS:
        parts = ["client", *parts]
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"--set {override!r}: {part} is not a section")
        node = child
    node[parts[-1]] = value
    return data
