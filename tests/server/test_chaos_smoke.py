"""The chaos benchmark's core at its smallest (``benchmarks/chaos.py``): two SIGKILLs of a real
``arctic-platform serve`` mid-save/overwrite, restarts on the same data dir, then one malformed body
per route of every API. Every acknowledged save survives and loads, nothing half-written is left,
and no request is answered 5xx."""

from __future__ import annotations

import pytest

from benchmarks.chaos import chaos, routes

pytestmark = pytest.mark.slow


def test_two_kills_lose_no_save_and_the_fuzz_gets_no_5xx(tmp_path):
    figures = chaos(tmp_path / "data", kills=2, fuzz_per_route=1, seed=0)
    assert figures["kills_survived"] == 2
    assert figures["saves_lost"] == 0, figures["saves_lost_detail"]
    assert figures["unloadable_listed"] == [] and figures["half_written_visible"] == []
    assert figures["checkpoints_loaded_after_kills"] >= 4  # two rounds' on-prem and Tinker saves
    assert figures["server_errors_5xx"] == 0, figures["server_errors_detail"]
    assert figures["fuzz_requests"] == len(routes("job", "cortex-job", "run"))  # all answered
