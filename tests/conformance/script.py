"""The conformance script: each op once with good input and once with bad input, on one surface.

:func:`run_script` drives one client (any surface) through the ops in the order an RL loop uses
them and returns what each answered: a normalised result (job ids and server paths left out, so
that two jobs' answers compare), or for a bad request its error as ``(status, code, field)``.
The tests hold the answers of every surface against each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from arctic_platform.client import ServerError
from arctic_platform.client.transport import Request
from arctic_platform.contract.engine_protocols import ENGINE_PROTOCOLS
from arctic_platform.contract.ops import OpName
from arctic_platform.layout import training_batch

PROMPTS = [[40, 41, 42], [50, 51, 52, 53]]
SAMPLING = {"n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 11, "logprobs": 1}
COMPLETIONS = [[43, 44], [54]]
# A token id no engine's vocabulary holds (the fake's is 128, the built-in tiny model's smaller).
OUT_OF_VOCAB = 10**6
# What each bad request's error message must name (its ``field`` detail, where the edge that
# refuses it sets one, is compared as well).
NAMED = {
    "generate!": "top_pp",
    "log_probs!": "prompts[0]",
    "forward!": "batch.input_ids",
    "fwd_bwd!": "no_such_loss",
    "step!": "learning_rate",
    "save!": "checkpoint_type",
    "load!": "checkpoint-999",
    "get job!": "wait_s",
}


def batch_of(samples: list[dict]) -> dict[str, np.ndarray]:
    """The verl-layout batch of the samples (prompt and response), advantages alternating."""
    prompts = [PROMPTS[s["prompt_index"]] for s in samples]
    responses = [list(s["token_ids"]) for s in samples]
    advantages = np.array([1.0 if i % 2 else -1.0 for i in range(len(samples))])
    return training_batch(prompts, responses, pad_token_id=0, advantages=advantages)


def refusal(send) -> tuple[int | None, str | None, str | None, str]:
    """``(status, code, field, message)`` of the error ``send()`` must raise."""
    try:
        send()
    except ServerError as exc:
        return exc.status, exc.code, exc.details.get("field"), exc.message
    raise AssertionError("the bad request was accepted")


def raw(client, op: str, role: str, body: Any, *, binary: bool = False) -> Any:
    """Send ``body`` as ``op`` through the client's transport, past the client's own checks:
    what reaches the surface's server edge."""
    job_id = getattr(client.jobs, role)
    return client.transport.call(Request(op, job_id, body, binary=binary))


def _without_job(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "job_id"}


def run_script(client) -> dict[str, Any]:
    """Every op's answer on ``client`` (see module doc), keyed by op; ``<op>!`` is its bad input."""
    out: dict[str, Any] = {}
    out["create job"] = sorted(
        role
        for role in ("training", "sampling", "log_prob")
        if getattr(client.jobs, role) is not None
    )
    status = raw(client, OpName.GET_JOB, "training", {"wait_s": 0.5})
    listed = client.jobs.training in {sub["sub_job_id"] for sub in status["sub_jobs"]}
    out["get job"] = {"status": status["status"], "lists the sub-job": listed}
    out["get job!"] = refusal(lambda: raw(client, OpName.GET_JOB, "training", {"wait_s": -1}))
    samples = client.generate(PROMPTS, SAMPLING)
    out["generate"] = samples
    out["generate!"] = refusal(
        lambda: raw(
            client,
            OpName.GENERATE,
            "sampling",
            {"prompts": PROMPTS, "sampling_params": {"top_pp": 1}},
        )
    )
    out["log_probs"] = client.log_probs(PROMPTS, COMPLETIONS, top_k=1)["results"]
    out["log_probs!"] = refusal(
        lambda: raw(client, OpName.LOG_PROBS, "log_prob", {"prompts": [[OUT_OF_VOCAB]]})
    )
    batch = batch_of(samples)
    out["forward"] = client.fwd_no_grad({"batch": batch})["batch"]["logprobs"]
    bad = dict(batch, input_ids=np.where(batch["attention_mask"] == 1, OUT_OF_VOCAB, 0))
    out["forward!"] = refusal(lambda: client.fwd_no_grad({"batch": bad}))
    train = {"batch": batch, "processing": {"loss_fn": "cross_entropy"}}
    out["fwd_bwd"] = _without_job(client.fwd_bwd(train))
    out["fwd_bwd!"] = refusal(
        lambda: client.fwd_bwd({"batch": batch, "processing": {"loss_fn": "no_such_loss"}})
    )
    out["step!"] = refusal(lambda: raw(client, OpName.STEP, "training", {"learning_rate": -1.0}))
    out["step"] = _without_job(client.step(learning_rate=1e-3))
    saved = client.save_checkpoint()
    out["save"] = {k: saved[k] for k in ("checkpoint_id", "global_step")}
    out["save!"] = refusal(lambda: client.save_checkpoint(checkpoint_type="everything"))
    out["forward after step"] = client.fwd_no_grad({"batch": batch})["batch"]["logprobs"]
    loaded = client.load_checkpoint(checkpoint_id=saved["checkpoint_id"])
    out["load"] = {k: loaded[k] for k in ("checkpoint_id", "global_step")}
    out["load!"] = refusal(lambda: client.load_checkpoint(checkpoint_id="checkpoint-999"))
    return out


def same(a, b) -> bool:
    """Equal answers, numpy arrays included (bitwise)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def protocols_met(service, client) -> dict[str, bool]:
    """For each of ``client``'s sub-jobs on ``service``: whether its engine has every member of
    its kind's Protocol (``contract/engine_protocols.py``)."""
    met = {}
    for kind in ENGINE_PROTOCOLS:
        sub_job_id = getattr(client.jobs, kind)
        engine = service.resolve(sub_job_id, owner=None).engine
        met[kind] = isinstance(engine, ENGINE_PROTOCOLS[kind])
    return met
