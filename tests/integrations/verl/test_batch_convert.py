"""verl batches <-> the wire layout, checked against verl's own padding helpers.

verl's trainer turns its padded ``DataProto`` into nested tensors with ``left_right_2_no_padding``
before calling a worker, and reads the worker's nested predict-next outputs back with
``no_padding_2_padding`` (verl 0.9) or ``response_from_nested`` (the TransferQueue trainers). The
conversions must invert the first and feed the others exactly.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import (
    left_right_2_no_padding,
    no_padding_2_padding,
    response_from_nested,
)

from arctic_platform.integrations.verl.batch_convert import (
    SequenceLayout,
    predict_next,
    response_field,
    wire_batch,
)

PAD = 7


def padded_batch(prompt_lens, response_lens, P=5, R=4, seed=0) -> TensorDict:
    """verl's padded layout (what the DataProto holds) with random tokens and values."""
    g = torch.Generator().manual_seed(seed)
    rows = len(prompt_lens)
    input_ids = torch.full((rows, P + R), PAD)
    attention_mask = torch.zeros(rows, P + R, dtype=torch.long)
    for b, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        input_ids[b, P - pl : P + rl] = torch.randint(10, 90, (pl + rl,), generator=g)
        attention_mask[b, P - pl : P + rl] = 1
    response_mask = attention_mask[:, P:].clone()
    return tu.get_tensordict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "prompts": input_ids[:, :P].clone(),
            "responses": input_ids[:, P:].clone(),
            "response_mask": response_mask,
            "advantages": torch.randn(rows, R, generator=g) * response_mask,
            "old_log_probs": -torch.rand(rows, R, generator=g) * response_mask,
        }
    )


def test_wire_batch_inverts_verls_unpadding():
    dense = padded_batch([5, 2, 1], [4, 1, 3])
    nested = left_right_2_no_padding(dense.clone())
    layout = SequenceLayout.of(nested)
    batch = wire_batch(
        nested, layout, pad_token_id=PAD, fields=("response_mask", "advantages", "old_log_probs")
    )
    assert torch.equal(batch["input_ids"], dense["input_ids"])
    assert torch.equal(batch["attention_mask"], dense["attention_mask"])
    assert torch.equal(batch["prompts"], dense["prompts"])
    assert torch.equal(batch["responses"], dense["responses"])
    for name in ("response_mask", "advantages", "old_log_probs"):
        assert batch[name][:, :5].abs().sum() == 0, name  # zeros over the prompt part
        torch.testing.assert_close(batch[name][:, 5:].to(dense[name].dtype), dense[name])
    assert batch["response_mask"].dtype == torch.long
    assert batch["advantages"].dtype == torch.float32


def test_nested_prompts_and_responses_give_the_reference_layout():
    """The TransferQueue trainers' form: prompts, responses and response fields all nested."""
    data = tu.get_tensordict(
        {
            "input_ids": torch.nested.as_nested_tensor(
                [torch.tensor([10, 11, 12, 30, 31]), torch.tensor([20, 21, 40, 41, 42])],
                layout=torch.jagged,
            ),
            "prompts": torch.nested.as_nested_tensor(
                [torch.tensor([10, 11, 12]), torch.tensor([20, 21])], layout=torch.jagged
            ),
            "responses": torch.nested.as_nested_tensor(
                [torch.tensor([30, 31]), torch.tensor([40, 41, 42])], layout=torch.jagged
            ),
            "advantages": torch.nested.as_nested_tensor(
                [torch.tensor([0.5, 0.5]), torch.tensor([-1.0, -1.0, -1.0])], layout=torch.jagged
            ),
        }
    )
    layout = SequenceLayout.of(data)
    batch = wire_batch(data, layout, pad_token_id=0, fields=("advantages",))
    assert batch["input_ids"].tolist() == [[10, 11, 12, 30, 31, 0], [0, 20, 21, 40, 41, 42]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]
    assert batch["advantages"].tolist() == [[0, 0, 0, 0.5, 0.5, 0], [0, 0, 0, -1, -1, -1]]


def position_indexed_values(layout: SequenceLayout) -> torch.Tensor:
    """Random values on every real token but each row's first (which has no log-prob)."""
    g = torch.Generator().manual_seed(4)
    mask = layout.attention_mask().bool()
    first = mask & (mask.long().cumsum(1) == 1)
    return torch.where(mask & ~first, -torch.rand(mask.shape, generator=g), 0.0)


def test_predict_next_feeds_verls_response_slicing():
    dense = padded_batch([5, 2, 1, 3], [4, 1, 3, 2], seed=2)
    nested = left_right_2_no_padding(dense.clone())
    layout = SequenceLayout.of(nested)
    values = position_indexed_values(layout)
    out = predict_next(values, layout)
    assert out.is_nested and torch.equal(out.offsets(), nested["input_ids"].offsets())
    # verl 0.9's trainer: values[L - resp_len - 1 : L - 1] per row, right-padded to R.
    response = no_padding_2_padding(out, nested)
    torch.testing.assert_close(response, values[:, 5:] * dense["response_mask"])
    # The TransferQueue trainers slice the same window from the nested tensor.
    lengths = layout.response_lens.tolist()
    rows = [row[:n] for row, n in zip(dense["response_mask"], lengths, strict=True)]
    nested_mask = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    for got, row in zip(response_from_nested(out, nested_mask).unbind(), range(4), strict=True):
        torch.testing.assert_close(got, values[row, 5 : 5 + int(layout.response_lens[row])])
    # Each sequence's last entry predicts nothing.
    assert all(float(seq[-1]) == 0.0 for seq in out.unbind())


def test_inconsistent_batches_name_the_field():
    nested = left_right_2_no_padding(padded_batch([2, 3], [2, 2]).clone())
    layout = SequenceLayout.of(nested)
    with pytest.raises(ValueError, match=r"batch.advantages: expected \[B, R\]"):
        response_field(torch.zeros(2, 3), layout, "advantages")
    with pytest.raises(ValueError, match="batch.ref_log_prob: missing"):
        wire_batch(nested, layout, pad_token_id=PAD, fields=("ref_log_prob",))
    broken = nested.clone()
    broken["attention_mask"][0, 3] = 0  # one response token fewer than input_ids holds
    with pytest.raises(ValueError, match="batch.input_ids: sequence lengths disagree"):
        SequenceLayout.of(broken)
    empty = left_right_2_no_padding(padded_batch([2, 1], [2, 2]).clone())
    empty["attention_mask"][1, :5] = 0
    with pytest.raises(ValueError, match="batch.prompts: row 1 has an empty prompt"):
        SequenceLayout.of(empty)
    with pytest.raises(ValueError, match="position-indexed"):
        predict_next(torch.zeros(2, 3), layout)
