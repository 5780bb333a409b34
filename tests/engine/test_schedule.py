"""Learning-rate schedules against their closed forms, directly and through the engine."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from arctic_platform.engine.config import SchedulerConfig
from arctic_platform.engine.schedule import lr_factor
from arctic_platform.engine.trainer import TrainingEngine
from tests.engine.rl_batches import engine_config, rl_batch


def closed_form(name: str, step: int, warmup: int, total: int, floor: float) -> float:
    if step < warmup:
        return step / warmup
    if name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    if name == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("warmup", "floor"), [(0, 0.0), (4, 0.1)])
def test_factor_matches_closed_form(name, warmup, floor):
    config = SchedulerConfig(name=name, warmup_steps=warmup, total_steps=20, min_lr_ratio=floor)
    for step in (0, 1, 3, 4, 5, 10, 19, 20, 25):
        want = closed_form(name, step, warmup, 20, floor)
        assert lr_factor(config, step) == pytest.approx(want, abs=1e-12), step


def test_chosen_values():
    cosine = SchedulerConfig(name="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.0)
    assert lr_factor(cosine, 0) == 0.0
    assert lr_factor(cosine, 1) == 0.5
    assert lr_factor(cosine, 2) == 1.0
    assert lr_factor(cosine, 7) == pytest.approx(0.5)  # half way through the decay
    assert lr_factor(cosine, 12) == pytest.approx(0.0, abs=1e-12)
    linear = SchedulerConfig(name="linear", total_steps=10, min_lr_ratio=0.2)
    assert lr_factor(linear, 5) == pytest.approx(0.6)


def test_engine_applies_the_schedule_and_the_override():
    scheduler = {"name": "linear", "warmup_steps": 2, "total_steps": 6}
    engine = TrainingEngine(engine_config(scheduler=scheduler, optimizer={"lr": 1e-3}))
    batch = rl_batch(rows=2, seed=1)
    config = SchedulerConfig(**scheduler)
    used = []
    for step in range(5):
        engine.forward_backward(batch)
        override = 2e-3 if step == 3 else None
        used.append(engine.step(learning_rate=override)["last_lr"])
    peaks = [1e-3, 1e-3, 1e-3, 2e-3, 2e-3]
    want = [peak * lr_factor(config, s) for s, peak in enumerate(peaks)]
    assert used == pytest.approx(want, rel=1e-12)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * lr_factor(config, 5))


def test_decaying_schedule_needs_total_steps():
    with pytest.raises(ValidationError, match="(?s)scheduler.*the cosine schedule needs it"):
        engine_config(scheduler={"name": "cosine"})
