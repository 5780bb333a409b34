"""Every op of the reference client, run under the reference client's own Python.

This file is passed as a script to the reference venv (``run_reference``), with the transport and
the server URL in ``sys.argv``. It imports nothing of ours: ``arctic_platform`` here is the
published 0.1.4. It prints one JSON line: what each op answered, reduced to plain values.
"""

import json
import os
import sys

import torch

from arctic_platform.client import (
    ArcticClientConfig,
    ArcticRLClient,
    CortexConfig,
    OnPremConfig,
    TrainingConfig,
)

KIND, HOST, PORT = sys.argv[1], sys.argv[2], int(sys.argv[3])
PROMPTS = [[40, 41, 42], [50, 51, 52, 53]]  # token ids of the built-in character tokenizer
LR = 1e-3
CHECKPOINTS = "reference-checkpoints"  # under the working directory the test gives


def config() -> ArcticClientConfig:
    if KIND == "onprem":
        backend = OnPremConfig(host=HOST, port=PORT)
    else:
        backend = CortexConfig(base_url=f"http://{HOST}:{PORT}", database="DB", schema="RL")
    return ArcticClientConfig(
        model_name="builtin:tiny",
        seed=0,
        max_seq_len=64,
        training_gpus=1,
        sampling_gpus=1,
        log_prob_gpus=1,
        backend=backend,
        training=TrainingConfig(
            # on-prem: the root where save_checkpoint() goes (the Cortex API has no such field)
            checkpoint_path=os.path.abspath(CHECKPOINTS) if KIND == "onprem" else None,
            ds_config={
                "optimizer": {"type": "AdamW", "params": {"lr": LR}},
                "gradient_clipping": 1.0,
            },
        ),
        job_ready_timeout=600,
    )


def batch_of(results: list) -> dict:
    """verl layout: prompt left-padded, response right-padded; position-indexed masks."""
    rows = [(list(r["prompt_ids"]), list(r["token_ids"])) for r in results]
    p = max(len(a) for a, _ in rows)
    width = p + max(len(b) for _, b in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    response = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        ids[i, p - len(prompt) : p + len(completion)] = torch.tensor(prompt + completion)
        mask[i, p - len(prompt) : p + len(completion)] = 1
        response[i, p : p + len(completion)] = 1
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response, "prompt_width": p}


def cortex_contract(batch: dict, advantages: torch.Tensor) -> dict:
    """The reference's Cortex grpo request: left-aligned rows, shifted context tensors."""
    mask = batch["attention_mask"].bool()
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    ids = batch["input_ids"].gather(1, order) * mask.sum(1, keepdim=True).gt(
        torch.arange(mask.shape[1])
    )
    lengths = mask.sum(1, keepdim=True)
    attention = (torch.arange(mask.shape[1]) < lengths).long()
    response = batch["response_mask"].gather(1, order).bool() & attention.bool()
    shifted = torch.zeros_like(response)
    shifted[:, :-1] = response[:, 1:]  # column i scores token i + 1
    return {
        "args": [],
        "kwargs": {"input_ids": ids, "attention_mask": attention},
        "context": {
            "input_ids": ids,
            "advantages": advantages[:, None] * shifted,
            "loss_mask": shifted,
        },
    }


def attempt(out: dict, name: str, call):
    """Record ``call()``'s answer, or that the reference client itself has no such op."""
    try:
        answer = call()
    except NotImplementedError as exc:  # raised by the client before anything is sent
        out[name] = {"client_refused": str(exc)}
        return None
    out[name] = summary(answer)
    return answer


def summary(answer):
    """Plain values: tensors as shapes."""
    if isinstance(answer, dict):
        return {k: summary(v) for k, v in answer.items()}
    if isinstance(answer, (list, tuple)):
        return [summary(v) for v in answer]
    if hasattr(answer, "shape"):
        return {"shape": list(answer.shape)}
    return answer


def main() -> None:
    out = {}
    client = ArcticRLClient(config())
    out["jobs"] = [client.jobs.training, client.jobs.sampling, client.jobs.log_prob]
    results = client.generate(PROMPTS, {"n": 2, "max_tokens": 5, "seed": 1, "logprobs": 1})
    out["generate"] = [
        {"token_ids": list(r["token_ids"]), "text": r["text"], "logprobs": r.get("logprobs")}
        for r in results
    ]
    for i, r in enumerate(results):
        r["prompt_ids"] = PROMPTS[i // 2]
    batch = batch_of(results)
    width = batch.pop("prompt_width")
    scoring = {"post": ["compute_entropy_and_logprobs"], "loss_fn": None}
    old = attempt(
        out, "fwd_no_grad", lambda: client.fwd_no_grad({"batch": batch, "processing": scoring})
    )
    attempt(
        out,
        "fwd_no_grad_ref",
        lambda: client.fwd_no_grad({"batch": batch, "processing": scoring}, reference_model=True),
    )
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    if old is not None:
        train = {
            "batch": {
                **batch,
                "prompts": batch["input_ids"][:, :width],
                "responses": batch["input_ids"][:, width:],
                "advantages": advantages[:, None] * batch["response_mask"],
                "old_log_probs": old["batch"]["logprobs"] * batch["response_mask"],
            },
            "meta": {"temperature": 1.0},
        }
        answer = client.fwd_bwd(train, processing={"loss_fn": "verl_grpo"})
    else:
        answer = client.fwd_bwd(
            cortex_contract(batch, advantages),
            processing={"post": ["compute_logprobs"], "loss_fn": "grpo", "config": {}},
        )
    out["fwd_bwd"] = {"avg_loss": float(answer["avg_loss"]), "keys": sorted(answer["metrics"])}
    step = client.step()
    out["step"] = {"last_lr": step.get("last_lr"), "global_steps": step.get("global_steps")}
    saved = client.save_checkpoint()
    out["save"] = {k: v for k, v in saved.items() if isinstance(v, (str, int))}
    attempt(out, "load", lambda: client.load_checkpoint(saved.get("path")))
    out["sync_weights"] = sorted(client.sync_weights())
    out["reset_prefix_cache"] = sorted(client.reset_prefix_cache())
    out["sleep_inference"] = sorted(client.sleep_inference(level=1))
    out["wake_inference"] = sorted(client.wake_inference())
    out["sleep_training"] = sorted(client.sleep_training())
    out["wake_training"] = sorted(client.wake_training())
    attempt(out, "log_probs", lambda: client.log_probs(["ab"], ["c"]))
    out["reconnect"] = sorted(
        k for k, v in client.reconnect_config().model_dump().items() if k.endswith("_job_id") and v
    )
    client.shutdown()
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
