"""Golden file of the wire payloads the adapter builds from a verl ``DataProto`` (wire regressions).

A fixed ``DataProto`` goes through verl's own trainer-side conversion (``to_tensordict`` and
``left_right_2_no_padding``, what verl hands the forwarder), then the adapter's
``log_prob_payload`` / ``update_payload``; each envelope is encoded with ``wire.dumps``. The golden
file holds a readable description of every envelope (keys, dtypes, shapes, values) and the sha256
of its frame: any change to the layout, the alignment, the meta keys or the wire encoding fails
here.

Regenerating the golden file is a deliberate act, never automatic. After checking that a change
is intended::

    python -m tests.integrations.verl.test_payload --regenerate
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

GOLDEN = Path(__file__).parent / "golden" / "wire_payloads.json"
PAD = 0
TEMPERATURE = 0.7
# (prompt, response) token ids: prompts of 3, 4 and 1 tokens, responses of 3, 1 and 2.
ROWS = (([11, 12, 13], [21, 22, 23]), ([14, 15, 16, 17], [24]), ([18], [25, 26]))
P, R = 4, 3
KNOB_OVERRIDES = (
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_type=k3+",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
)


def fixed_data_proto():
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_response_mask

    rows = len(ROWS)
    prompts = torch.full((rows, P), PAD)
    responses = torch.full((rows, R), PAD)
    attention_mask = torch.zeros(rows, P + R, dtype=torch.long)
    for b, (prompt, response) in enumerate(ROWS):
        prompts[b, P - len(prompt) :] = torch.tensor(prompt)
        responses[b, : len(response)] = torch.tensor(response)
        attention_mask[b, P - len(prompt) : P + len(response)] = 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    data = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
        },
        non_tensors={"uid": np.array(["a", "a", "b"], dtype=object)},
        meta_info={"temperature": TEMPERATURE},
    )
    mask = compute_response_mask(data)
    steps = torch.arange(R, dtype=torch.float32)
    data.batch["response_mask"] = mask
    data.batch["advantages"] = torch.tensor([[0.5], [-1.25], [2.0]]) * mask
    data.batch["old_log_probs"] = (-0.5 - 0.25 * steps - torch.arange(rows)[:, None]) * mask
    data.batch["ref_log_prob"] = (-0.75 - 0.125 * steps) * mask
    data.batch["rollout_is_weights"] = (1.0 + 0.5 * steps) * mask
    return data


def envelopes(main_config) -> dict[str, dict]:
    from verl.workers.utils.padding import left_right_2_no_padding

    from arctic_platform.integrations.verl.adapter import log_prob_payload, update_payload
    from arctic_platform.integrations.verl.verl_config import loss_knobs

    actor_config, policy_loss_config = loss_knobs(main_config)
    data = left_right_2_no_padding(fixed_data_proto().to_tensordict())
    log_prob, _ = log_prob_payload(
        data, pad_token_id=PAD, temperature=TEMPERATURE, calculate_entropy=True
    )
    update, _ = update_payload(
        data,
        actor_config=actor_config,
        policy_loss_config=policy_loss_config,
        pad_token_id=PAD,
        temperature=TEMPERATURE,
        calculate_entropy=False,
    )
    return {"log_prob": log_prob, "update": update}


def describe(value):
    """A JSON-able description: tensors as dtype, shape and values; containers recursively."""
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype), "shape": list(value.shape), "values": value.tolist()}
    if isinstance(value, dict):
        return {key: describe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(item) for item in value]
    return value


def golden_record(main_config) -> dict:
    from arctic_platform import wire

    record = {}
    for name, envelope in envelopes(main_config).items():
        frame = wire.dumps(envelope)
        record[name] = {
            "sha256": hashlib.sha256(frame).hexdigest(),
            "frame_bytes": len(frame),
            "envelope": describe(envelope),
        }
    return record


def test_wire_payloads_match_the_golden_file(compose_verl):
    want = json.loads(GOLDEN.read_text())
    got = json.loads(json.dumps(golden_record(compose_verl(*KNOB_OVERRIDES))))
    for name in want:
        assert got[name]["envelope"] == want[name]["envelope"], name
        assert got[name]["sha256"] == want[name]["sha256"], f"{name}: the frame's bytes changed"
    assert set(got) == set(want)


def test_the_golden_layout_is_position_indexed(compose_verl):
    """The golden values themselves, checked by hand: prompts left-padded to P, responses right-
    padded, response token k of a row at column P + k with its per-token values."""
    update = envelopes(compose_verl(*KNOB_OVERRIDES))["update"]
    batch = update["batch"]
    assert batch["input_ids"].tolist() == [
        [0, 11, 12, 13, 21, 22, 23],
        [14, 15, 16, 17, 24, 0, 0],
        [0, 0, 0, 18, 25, 26, 0],
    ]
    assert batch["attention_mask"].tolist() == [
        [0, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0],
    ]
    assert batch["response_mask"][:, :P].sum() == 0
    assert batch["old_log_probs"][1].tolist() == [0.0, 0.0, 0.0, 0.0, -1.5, 0.0, 0.0]
    assert batch["advantages"][2].tolist() == [0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0]
    assert set(batch) == {
        "input_ids",
        "attention_mask",
        "prompts",
        "responses",
        "response_mask",
        "advantages",
        "old_log_probs",
        "ref_log_prob",
        "rollout_is_weights",
    }
    meta = update["meta"]
    assert (meta["global_batch_size"], meta["batch_num_tokens"]) == (3, 6)
    assert meta["actor_config"]["kl_loss_type"] == "k3+"
    assert meta["actor_config"]["clip_ratio_high"] == 0.28
    assert update["processing"]["loss_fn"] == "verl_grpo"


def main(argv: list[str]) -> int:
    if argv != ["--regenerate"]:
        print(__doc__)
        return 2
    from tests.integrations.verl.conftest import compose_config, install_standin

    install_standin()
    record = golden_record(compose_config(*KNOB_OVERRIDES))
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=1, sort_keys=True)
    # One line per innermost list (a tensor row), so diffs stay readable.
    text = re.sub(r"\[\s+([^\[\]{}]+?)\s+\]", lambda m: "[" + " ".join(m[1].split()) + "]", text)
    GOLDEN.write_text(text + "\n")
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
