"""The GPU check's benchmark on a CPU, in CI: ``benchmarks/gpu_smoke.py --device cpu --tiny``
runs every phase on a tiny model, so the code a GPU lease runs (rarely lent, minutes long) is
known to work before one is spent on it."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_smoke


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "gpu_smoke.json"
    status = gpu_smoke.main(["--device", "cpu", "--tiny", "--out", str(out)])
    return status, json.loads(out.read_text())


def test_every_phase_runs_and_passes_its_checks(dry_run):
    status, result = dry_run
    assert status == 0, result["checks"]
    assert set(result["checks"]) >= {"train losses finite", "every sample ran to length"}
    assert all(result["checks"].values())
    for phase in ("train", "fsdp"):
        assert result[phase]["fwd_bwd"]["tokens_per_s"] > 0
    sample = result["sample"]
    expected = sample["tokens_per_s"] / result["hf_generate"]["tokens_per_s"]
    assert sample["ratio_to_hf_generate"] == pytest.approx(expected)
    assert result["weight_sync"]["sampler_equals_trainer"]


def test_a_failing_phase_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_smoke, "run_sample", broken)
    out = tmp_path / "gpu_smoke.json"
    status = gpu_smoke.main(
        ["--device", "cpu", "--tiny", "--phases", "train,sample", "--out", str(out)]
    )
    result = json.loads(out.read_text())
    assert status == 1
    assert result["sample"] == {
        "error": "RuntimeError: CUDA error: an illegal memory access was encountered"
    }
    assert result["train"]["losses_finite"] and "fsdp" not in result
    assert result["checks"]["train losses finite"]
    assert not result["checks"]["every sample ran to length"]


def test_unknown_phase_is_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        gpu_smoke.main(["--device", "cpu", "--tiny", "--phases", "train,warmup"])
    assert "--phases: unknown ['warmup']" in capsys.readouterr().err
