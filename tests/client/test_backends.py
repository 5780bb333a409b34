"""The same GRPO step on every backend: same response keys, same numbers, same weights.

``inprocess`` runs the engines here; ``http`` and ``cortex`` talk to our real server on a
loopback port; ``ray`` runs them in actors on a real 2-CPU Ray cluster (one training worker, so
the arithmetic is the in-process engine's). With the same seeds every backend must end with
bitwise-equal weights, read back through ``fwd_no_grad`` log-probs, and errors must surface as
the same exception types.
"""

from __future__ import annotations

import numpy as np
import pytest

from arctic_platform.client import InvalidRequestError, create_arctic_rl_client
from tests.client.conftest import TINY, backend_config
from tests.client.grpo import PROMPTS, SAMPLING, build_batch, run_grpo

BACKENDS = ("inprocess", "http", "cortex", "ray")


def grpo_config(kind: str, url: str, data_dir) -> dict:
    if kind == "ray":
        from tests.ray.cluster import ray_backend, start_ray

        start_ray()
        backend = ray_backend(data_dir)
    else:
        backend = backend_config(kind, url, data_dir)
    return {
        "model": TINY,
        "seed": 3,
        "tensor_type": "numpy",
        "backend": backend,
        "training": {"optimizer": {"lr": 1e-3}},
        "sampling": {},
        "log_prob": {},
    }


@pytest.fixture(scope="module")
def runs(server_url, tmp_path_factory):
    """Each backend's client and the responses of one GRPO run on it."""
    out = {}
    for kind in BACKENDS:
        config = grpo_config(kind, server_url, tmp_path_factory.mktemp(kind))
        client = create_arctic_rl_client(config, blocking_calls=True)
        out[kind] = (client, run_grpo(client))
    yield out
    for client, _ in out.values():
        client.shutdown()


@pytest.mark.parametrize("kind", BACKENDS)
def test_response_keys_match_the_contract(runs, kind):
    _, run = runs[kind]
    assert set(run["fwd_bwd"]) == {"job_id", "avg_loss", "loss", "metrics"}
    assert run["fwd_bwd"]["loss"] == run["fwd_bwd"]["avg_loss"]
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "kl_loss", "loss"} <= set(
        run["fwd_bwd"]["metrics"]
    )
    assert set(run["old"]) == {"job_id", "batch", "model_outputs", "metrics", "avg_loss", "loss"}
    assert run["old"]["batch"] is run["old"]["model_outputs"]
    assert {"job_id", "global_steps", "last_lr", "grad_norm", "metrics"} <= set(run["step"])
    assert run["step"]["metrics"]["grad_norm"] == run["step"]["grad_norm"]
    assert run["step"]["grad_norm"] > 0
    assert (
        isinstance(run["generate"], list) and len(run["generate"]) == len(PROMPTS) * SAMPLING["n"]
    )
    first = run["generate"][0]
    assert {"text", "token_ids", "finish_reason", "prompt_len"} <= set(first)
    assert type(first["token_ids"]) is list and all(type(t) is int for t in first["token_ids"])
    assert run["sync_weights"]["status"] == "ok"
    assert run["save"]["global_step"] == 1 and run["load"]["global_step"] == 1
    assert run["step_2"]["global_steps"] == 2
    client, _ = runs[kind]
    assert run["fwd_bwd"]["job_id"] == client.training_job_id
    assert run["ref"]["job_id"] == client.log_prob_job_id


def test_all_backends_see_the_same_keys(runs):
    def keys(run):
        return {
            call: sorted(v) for call, v in run.items() if isinstance(v, dict) and call != "batch"
        }

    reference = keys(runs["inprocess"][1])
    for kind in BACKENDS[1:]:
        assert keys(runs[kind][1]) == reference, kind


def test_all_backends_train_to_the_same_weights(runs):
    base = runs["inprocess"][1]
    for kind in BACKENDS[1:]:
        run = runs[kind][1]
        assert run["generate"] == base["generate"], kind
        for call in ("fwd_bwd", "fwd_bwd_2"):
            assert run[call]["metrics"] == base[call]["metrics"], (kind, call)
        for call in ("step", "step_2"):
            assert run[call]["grad_norm"] == base[call]["grad_norm"], (kind, call)
        np.testing.assert_array_equal(
            run["final"]["batch"]["logprobs"], base["final"]["batch"]["logprobs"]
        )
        assert run["generate_after_sync"] == base["generate_after_sync"], kind


def test_the_run_changed_the_weights_and_the_sampler(runs):
    """Guards the comparison above: two steps moved the policy, and weight sync reached the
    sampler (the same seeded request now samples differently)."""
    run = runs["inprocess"][1]
    mask = run["batch"]["response_mask"].astype(bool)
    before, after = run["old"]["batch"]["logprobs"], run["final"]["batch"]["logprobs"]
    assert np.abs(after[mask] - before[mask]).max() > 1e-3
    assert run["generate_after_sync"] != run["generate"]


def test_responses_decode_as_numpy(runs):
    for kind in BACKENDS:
        logprobs = runs[kind][1]["final"]["batch"]["logprobs"]
        assert isinstance(logprobs, np.ndarray) and logprobs.dtype == np.float32, kind


@pytest.mark.parametrize("kind", BACKENDS)
def test_bad_tensors_are_the_same_error_everywhere_and_change_nothing(runs, kind):
    client, run = runs[kind]
    batch = build_batch(run["generate"])
    before = client.fwd_no_grad({"batch": batch})["batch"]["logprobs"]
    bad = dict(batch, input_ids=np.where(batch["attention_mask"] == 1, 500, 0))
    with pytest.raises(InvalidRequestError) as info:
        client.fwd_bwd({"batch": bad, "processing": {"loss_fn": "verl_grpo"}})
    assert info.value.status == 400 and info.value.code == "invalid_argument"
    assert "batch.input_ids" in info.value.message
    np.testing.assert_array_equal(client.fwd_no_grad({"batch": batch})["batch"]["logprobs"], before)


@pytest.mark.parametrize("kind", BACKENDS)
def test_bad_bodies_are_the_same_error_everywhere(runs, kind):
    client, _ = runs[kind]
    with pytest.raises(InvalidRequestError) as info:
        client.save_checkpoint(checkpoint_type="everything")
    assert info.value.status == 400 and "checkpoint_type" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        client.generate(PROMPTS, {"temperature": 1.0, "top_pp": 0.9})
    assert "top_pp" in str(info.value)


def test_log_probs_are_the_same_everywhere(runs):
    answers = {}
    for kind in BACKENDS:
        client, run = runs[kind]
        completions = [r["token_ids"] for r in run["generate"][:2]]
        answers[kind] = client.log_probs(PROMPTS, completions, top_k=2)
    base = answers["inprocess"]
    assert set(base) == {"job_id", "results"} and len(base["results"]) == len(PROMPTS)
    for kind in BACKENDS[1:]:
        assert answers[kind]["results"] == base["results"], kind


def test_colocation_ops_answer_alike_everywhere(runs):
    answers = {}
    for kind in BACKENDS:
        client, _ = runs[kind]
        answers[kind] = {
            "sleep_inference": client.sleep_inference(level=2),
            "wake_inference": client.wake_inference(["weights", "kv_cache"]),
            "sleep_training": client.sleep_training(),
            "wake_training": client.wake_training(),
            "empty_training_cache": client.empty_training_cache(),
            "reset_prefix_cache": client.reset_prefix_cache(),
            "finalize_pending_saves": client.finalize_pending_saves(),
        }
        assert answers[kind]["sleep_inference"]["job_id"] == client.sampling_job_id
        assert answers[kind]["empty_training_cache"]["job_id"] == client.training_job_id
        assert answers[kind]["finalize_pending_saves"]["pending_saves"] == 0

    def without_ids(answer):
        return {k: v for k, v in answer.items() if k != "job_id"}

    for kind in BACKENDS[1:]:
        for call, answer in answers[kind].items():
            assert without_ids(answer) == without_ids(answers["inprocess"][call]), (kind, call)
    # The sampler woke up and still answers the same seeded request the same way everywhere.
    after = [runs[kind][0].generate(PROMPTS, SAMPLING) for kind in BACKENDS]
    assert all(answer == after[0] for answer in after[1:])
