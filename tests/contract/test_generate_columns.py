"""Generate results as tensor columns: exact round trips, fallbacks that lose nothing, errors.

The column form is checked against the reference list form it replaces: ``unpack(pack(x)) == x``
for the outputs the sampler makes (with and without logprobs and alternatives, unicode text,
empty completions), for values no column can hold exactly, and through a real DSSST1 frame.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from arctic_platform import wire
from arctic_platform.contract import generate_columns as gc


def sample(ids, *, k=None, text="ab", **extra):
    out = {
        "text": text,
        "token_ids": list(ids),
        "finish_reason": "length",
        "stop_reason": None,
        "prompt_len": 3,
        "prompt_index": 0,
        "sample_index": 0,
    }
    if k is not None:
        rng = np.random.default_rng(len(ids) + k)

        def value():
            return float(np.float32(-rng.random()))

        out["logprobs"] = [
            {
                "token_id": t,
                "logprob": value(),
                "top": [[int(rng.integers(100)), value()] for _ in range(k)],
            }
            for t in ids
        ]
    out.update(extra)
    return out


CASES = {
    "plain": [sample([1, 2, 3]), sample([4], text="é✓", finish_reason="stop", stop_reason=7)],
    "logprobs": [sample([5, 6], k=0), sample([7, 8, 9], k=0)],
    "alternatives": [sample([5, 6], k=2), sample([], k=3), sample([1], k=1)],
    "mixed": [sample([1, 2], k=1), sample([3]), sample([4, 5], k=0, stop_reason="###")],
    "empty_completion": [sample([], text="")],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_columns_round_trip_exactly_through_a_frame(name):
    results = CASES[name]
    frame = wire.dumps({"job_id": "j", **gc.as_columns({"results": results})})
    decoded = wire.loads(frame)
    assert gc.results_of(decoded) == results
    assert decoded["job_id"] == "j"


def test_token_ids_and_logprobs_travel_as_tensors():
    columns = gc.pack(CASES["alternatives"])
    assert columns["token_ids"].dtype == np.int32
    assert columns["token_offsets"].tolist() == [0, 2, 2, 3]
    assert columns["top_k"].tolist() == [2, 0, 1]  # an empty completion has no alternatives
    assert columns["top_ids"].shape == (2 * 2 + 0 + 1,)
    assert columns["extra"] is None


def test_values_no_column_holds_exactly_travel_per_sample():
    odd = [
        sample([1, 2], k=0, seed=5),  # a field without a column
        {**sample([3], k=0), "logprobs": [{"token_id": 9, "logprob": -0.5, "top": []}]},
        {**sample([4], k=0), "logprobs": [{"token_id": 4, "logprob": -0.1, "top": []}]},
        {**sample([5]), "prompt_len": None},
        {**sample([6]), "logprobs": None},
    ]
    columns = gc.pack(odd)
    assert columns["extra"][0]["seed"] == 5
    assert "prompt_len" not in columns  # one sample's None keeps the field per sample
    assert "logprobs" in columns["extra"][1]  # names another token than the sample's own
    assert "logprobs" in columns["extra"][2]  # -0.1 is not a float32 value
    assert gc.unpack(wire.loads(wire.dumps(columns))) == odd


def test_a_header_stays_small_whatever_the_rollout_size():
    samples, length = 2048, 4096
    columns = {
        "count": samples,
        "token_ids": np.zeros(samples * length, np.int32),
        "token_offsets": np.arange(samples + 1, dtype=np.int64) * length,
        "logprob": np.full(samples * length, -0.5, np.float32),
        "has_logprobs": np.ones(samples, bool),
        "top_k": np.zeros(samples, np.int32),
        "top_ids": np.zeros(0, np.int32),
        "top_logprobs": np.zeros(0, np.float32),
        "finish_reason": ["length"] * samples,
        "extra": None,
    }
    frame = wire.dumps({"job_id": "j", gc.COLUMNS_KEY: columns})
    (header_size,) = np.frombuffer(frame[:8], "<u8")
    assert header_size < 256 * 1024
    decoded = wire.loads(frame)[gc.COLUMNS_KEY]
    assert np.array_equal(decoded["logprob"], columns["logprob"])


def test_the_reference_form_of_a_long_rollout_overflows_the_frame_header():
    """Why the columns exist: a few hundred samples with logprobs already pass the 64 MiB
    header limit in the list form (the issue's 2048 x 4096 is 67 MB of header for the ids)."""
    entry = {"token_id": 1234, "logprob": -1.2345678, "top": []}
    per_sample = len(json.dumps(entry)) + 2
    samples = wire.MAX_HEADER_BYTES // (per_sample * 4096) + 1
    results = [{"token_ids": [1234] * 4096, "logprobs": [entry] * 4096}] * samples
    with pytest.raises(wire.WireError, match="header length"):
        wire.loads(wire.dumps({"results": results}))


@pytest.mark.parametrize(
    ("change", "name"),
    [
        (lambda c: c.update(count=-1), "count"),
        (lambda c: c.update(token_offsets=np.array([0, 9, 3])), "token_offsets"),
        (lambda c: c.update(text_offsets=np.array([0, 1])), "text_offsets"),
        (lambda c: c.update(prompt_len=np.zeros(5, np.int64)), "prompt_len"),
        (lambda c: c.update(finish_reason="length"), "finish_reason"),
        (lambda c: c.update(logprob=np.zeros(1, np.float32)), "logprob"),
        (lambda c: c.update(top_ids=np.zeros(0, np.int32)), "top_ids"),
        (lambda c: c.update(extra=[1, 2]), "extra"),
    ],
)
def test_inconsistent_columns_are_an_error_naming_the_column(change, name):
    columns = gc.pack([sample([1, 2], k=1), sample([3], k=1)])
    change(columns)
    with pytest.raises(ValueError, match=name):
        gc.unpack(columns)


def test_only_frames_that_ask_get_columns():
    assert gc.wants_columns(gc.request_columns({"response_options": {"format": "dssst1"}}))
    assert (
        gc.request_columns({"response_options": {"format": "dssst1"}})["response_options"]["format"]
        == "dssst1"
    )
    assert not gc.wants_columns({"response_options": {"format": "dssst1", "delivery": "chunked"}})
    assert not gc.wants_columns({})
