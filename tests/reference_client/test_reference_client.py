"""The published reference client (PyPI ``arctic-platform==0.1.4``), unmodified, against
``arctic-platform serve``: its Cortex transport and its on-prem HTTP transport, every op.

The client runs in its own environment (:mod:`.environment`); :mod:`.drive` is the script it runs.
Ops the reference Cortex transport does not have (it raises ``NotImplementedError`` before sending
anything: ``forward``, ``load-checkpoint``, ``log-probs``) are the only ones allowed to be missing,
and only there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arctic_platform.client.local_server import LocalServer
from tests.reference_client.environment import Unavailable, reference_python, run_reference

pytestmark = pytest.mark.slow

DRIVE = Path(__file__).with_name("drive.py")
CORTEX_CLIENT_LACKS = {"fwd_no_grad", "fwd_no_grad_ref", "load", "log_probs"}


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    cache = tmp_path_factory.getbasetemp().parent / "reference-client-0.1.4"
    try:
        return reference_python(cache)
    except Unavailable as exc:
        pytest.skip(f"the reference client could not be fetched from PyPI (offline?): {exc}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LocalServer(data_dir=tmp_path_factory.mktemp("served"), device="cpu") as url:
        yield url


def drive(reference: Path, kind: str, url: str, scratch: Path) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    script = DRIVE.read_text()
    stdout = run_reference(
        reference,
        f"import sys; sys.argv = ['drive', {kind!r}, {host!r}, {port!r}]\n" + script,
        cwd=scratch,
    )
    return json.loads(stdout.strip().splitlines()[-1])


def refused(answers: dict) -> set[str]:
    return {k for k, v in answers.items() if isinstance(v, dict) and "client_refused" in v}


def check_generate(answers: dict) -> None:
    """vLLM's per-position shape: ``{token_id: {logprob, rank, decoded_token}}``."""
    assert len(answers["generate"]) == 4
    for result in answers["generate"]:
        assert len(result["logprobs"]) == len(result["token_ids"]) > 0
        for token, position in zip(result["token_ids"], result["logprobs"], strict=True):
            assert str(token) in position
            for entry in position.values():
                assert set(entry) == {"logprob", "rank", "decoded_token"} and entry["rank"] >= 1


def check_training(answers: dict) -> None:
    assert answers["step"] == {"last_lr": 1e-3, "global_steps": 1}  # ds_config's lr, honoured
    assert answers["save"]["global_step"] == 1
    assert answers["sync_weights"] == ["job_id", "status", "targets"]
    assert answers["reconnect"] == ["log_prob_job_id", "sampling_job_id", "training_job_id"]


def test_reference_onprem_transport_runs_every_op(reference, server, tmp_path):
    answers = drive(reference, "onprem", server, tmp_path)
    assert refused(answers) == set()
    check_generate(answers)
    check_training(answers)
    width = answers["fwd_no_grad"]["batch"]["logprobs"]["shape"]
    assert width[0] == 4 and answers["fwd_no_grad_ref"]["batch"]["logprobs"]["shape"] == width
    assert {"actor/pg_loss", "actor/ppo_kl", "loss"} <= set(answers["fwd_bwd"]["keys"])
    assert answers["load"]["global_step"] == 1
    # checkpoint_path sent at /initialize is where a save without path goes
    assert Path(answers["save"]["path"]).is_relative_to(tmp_path / "reference-checkpoints")
    assert len(answers["log_probs"]["results"][0]["logprobs"]) == 1
    for op in ("sleep_inference", "wake_inference", "reset_prefix_cache"):
        assert answers[op] == ["job_id", "sampling"], op
    for op in ("sleep_training", "wake_training"):
        assert answers[op] == ["job_id", "workers"], op


def test_reference_cortex_transport_runs_every_op_it_has(reference, server, tmp_path):
    answers = drive(reference, "cortex", server, tmp_path)
    assert refused(answers) == CORTEX_CLIENT_LACKS
    check_generate(answers)
    check_training(answers)
    # the grpo contract: compute_logprobs + grpo over context tensors
    assert {"approx_kl", "clip_ratio", "importance_weight", "loss"} <= set(
        answers["fwd_bwd"]["keys"]
    )
    assert answers["reset_prefix_cache"] == ["job_id", "sampling"]
