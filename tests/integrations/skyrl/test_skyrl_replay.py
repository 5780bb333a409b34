"""SkyRL's driver, replayed (``replay_driver``) with SkyRL's real defaults (flash-attention 2,
liger, ZeRO, chunked logits, Arctic Inference): every call answers, and nothing outlives it.

The driver never calls ``shutdown()``; after it exits, no process it started may remain: neither
a launched ``arctic-platform serve`` (http) nor the Ray cluster it started (ray). Both protocols
run the same seeded step, so their answers must agree.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import wait_until

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
# SkyRL's GPU defaults that have no effect on these engines: accepted, reported, never fatal.
REPORTED = {
    "ds_worker_config.use_liger",
    "ds_worker_config.zorro_train_enable",
    "ds_worker_config.use_unpad",
    "ds_config.zero_optimization",
    "ds_config.bf16",
    "ds_config.sequence_parallel_size",
    "arctic_inference_config",
}


def processes_in(folder: Path) -> list[int]:
    """Pids of live processes whose working directory is ``folder`` (what the driver started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if Path(os.readlink(entry / "cwd")) == folder:
                state = (entry / "stat").read_text().split(") ")[1][0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def replay(protocol: str, folder: Path) -> dict:
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled")
    result = subprocess.run(
        [sys.executable, "-m", "tests.integrations.skyrl.replay_driver", protocol],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    wait_until(
        lambda: not processes_in(folder) and not listening(answer["gcs_address"]),
        what=f"the {protocol} driver's processes and Ray GCS {answer['gcs_address']} gone",
        interval_s=0.2,
    )
    return answer


def test_skyrl_driver_sequence_on_http_and_ray_leaves_nothing_behind(tmp_path):
    answers = {protocol: replay(protocol, tmp_path / protocol) for protocol in ("http", "ray")}
    for protocol, answer in answers.items():
        assert answer["comm_protocol"] == protocol  # rl_config.comm_protocol reads back as set
        outputs = answer["outputs"]
        assert len(outputs) == 4
        assert all(o["token_ids"] and o["finish_reason"] in ("stop", "length") for o in outputs)
        assert answer["logprobs_shape"][0] == 4
        assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "loss"} <= set(
            answer["metrics"]
        )
        assert math.isfinite(answer["grad_norm"]) and answer["grad_norm"] > 0
        assert answer["saved"]["global_step"] == 1
        saved = Path(answer["saved"]["path"])  # where SkyRL's absolute ckpt_path points
        assert saved.parent == tmp_path / protocol / "ckpts" and saved.is_dir()
        assert answer["job_ids"][0] and answer["job_ids"][1] and answer["job_ids"][2] is None
        # SkyRL's real defaults ran: flash-attention 2 was asked for and, where flash_attn is
        # missing, the job degraded to sdpa and lists it; the other GPU knobs stay reported.
        training = answer["training_job"]
        assert training["training_config"]["attn_implementation"] == "flash_attention_2"
        fallback = training["ignored_settings"].get("attn_implementation")
        if importlib.util.find_spec("flash_attn") is None:
            assert fallback == "flash_attention_2 -> sdpa (flash_attn is not installed)"
        else:
            assert fallback is None
        assert set(answer["client_ignored"]) >= REPORTED
    http, ray = answers["http"], answers["ray"]
    assert http["outputs"] == ray["outputs"]  # same seeds, same engines: same step
    assert http["grad_norm"] == pytest.approx(ray["grad_norm"], rel=1e-4)
    for name, value in http["metrics"].items():
        assert ray["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6)
