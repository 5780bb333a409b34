"""Byte chunks: split, reassemble in any order, and refuse anything that does not add up."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from arctic_platform import wire


@pytest.fixture(scope="module")
def frame() -> bytes:
    return wire.dumps({"w": np.random.default_rng(0).standard_normal(5000).astype(np.float32)})


def chunks_of(frame: bytes, max_bytes: int = 4096, **kwargs) -> list[bytes]:
    return wire.encode_byte_chunks(frame, kind="request", max_bytes=max_bytes, **kwargs)


def test_frames_that_fit_pass_through_unchanged(frame):
    assert wire.encode_byte_chunks(frame, kind="request") == [frame]
    assert wire.encode_byte_chunks(frame, kind="request", max_bytes=len(frame)) == [frame]
    assert wire.decode_byte_chunks([frame]) == frame


@pytest.mark.parametrize("max_bytes", [700, 4096, 10_000])
def test_chunks_respect_max_bytes_and_describe_the_group(frame, max_bytes):
    chunks = chunks_of(frame, max_bytes, operation="forward-backward", chunk_group_id="g-1")
    assert len(chunks) > 1 and all(len(c) <= max_bytes for c in chunks)
    descriptors = [wire.read_byte_chunk_metadata(c) for c in chunks]
    assert [d["chunk_idx"] for d in descriptors] == list(range(len(chunks)))
    for d in descriptors:
        assert d == {
            "chunk_idx": d["chunk_idx"],
            "total_chunks": len(chunks),
            "frame_sha256": hashlib.sha256(frame).hexdigest(),
            "frame_size_bytes": len(frame),
            "chunk_group_id": "g-1",
            "operation": "forward-backward",
            "kind": "request",
        }


def test_reassembly_in_any_order(frame):
    chunks = chunks_of(frame)
    for seed in range(5):
        shuffled = chunks[:]
        random.Random(seed).shuffle(shuffled)
        assert wire.decode_byte_chunks(shuffled, kind="request") == frame


def test_request_chunks_get_a_fresh_group_id_and_result_chunks_none(frame):
    first = wire.read_byte_chunk_metadata(chunks_of(frame)[0])
    second = wire.read_byte_chunk_metadata(chunks_of(frame)[0])
    assert first["chunk_group_id"] != second["chunk_group_id"]
    result = wire.encode_byte_chunks(frame, kind="result", max_bytes=4096)
    assert "chunk_group_id" not in wire.read_byte_chunk_metadata(result[0])
    assert wire.read_byte_chunk_metadata(result[0])["kind"] == "result"


def test_force_chunk_wraps_a_small_frame_as_one_chunk(frame):
    chunks = wire.encode_byte_chunks(frame, kind="request", force_chunk=True)
    assert len(chunks) == 1
    meta = wire.read_byte_chunk_metadata(chunks[0])
    assert meta["total_chunks"] == 1 and meta["chunk_group_id"]
    assert wire.decode_byte_chunks(chunks) == frame
    empty = wire.encode_byte_chunks(b"", kind="request", force_chunk=True)
    assert wire.decode_byte_chunks(empty) == b""


def test_result_chunks_round_trip_objects():
    result = {"logprobs": np.arange(3000, dtype=np.float32), "metrics": {"loss": 0.5}}
    chunks = wire.encode_result_chunks(result, max_bytes=2048)
    assert len(chunks) > 1
    decoded = wire.decode_result_chunks(chunks[::-1])
    assert decoded["logprobs"].tolist() == result["logprobs"].tolist()
    assert decoded["metrics"] == {"loss": 0.5}


def test_missing_duplicate_and_foreign_chunks(frame):
    chunks = chunks_of(frame)
    with pytest.raises(wire.WireError, match=f"expected {len(chunks)} byte chunks"):
        wire.decode_byte_chunks(chunks[:-1])
    with pytest.raises(wire.WireError, match="duplicate chunk_idx 0"):
        wire.decode_byte_chunks([chunks[0], *chunks[:-1]])
    other = chunks_of(frame)  # same frame, another group id
    with pytest.raises(wire.WireError, match="different frames or chunk groups"):
        wire.decode_byte_chunks([other[0], *chunks[1:]])
    with pytest.raises(wire.WireError, match="without chunk metadata"):
        wire.decode_byte_chunks([frame, *chunks[1:]])
    with pytest.raises(wire.WireError, match="no chunks"):
        wire.decode_byte_chunks([])


def test_kind_must_match(frame):
    results = wire.encode_byte_chunks(frame, kind="result", max_bytes=4096)
    with pytest.raises(wire.WireError, match="expected request chunks, got result chunks"):
        wire.decode_byte_chunks(results, kind="request")
    with pytest.raises(wire.WireError, match="chunk kind must be"):
        wire.encode_byte_chunks(frame, kind="reply", max_bytes=4096)


def _rechunk(frame: bytes, desc_update: dict, payloads=None) -> list[bytes]:
    """Build chunk frames by hand, with a tampered descriptor or payloads."""
    size = len(frame)
    step = 3000
    parts = payloads or [frame[i : i + step] for i in range(0, size, step)]
    base = {
        "total_chunks": len(parts),
        "frame_sha256": hashlib.sha256(frame).hexdigest(),
        "frame_size_bytes": size,
        "chunk_group_id": "g",
    }
    out = []
    for i, part in enumerate(parts):
        desc = {"chunk_idx": i, **base, **desc_update}
        out.append(
            wire.dumps({"payload": np.frombuffer(part, np.uint8)}, metadata={"request_chunk": desc})
        )
    return out


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"frame_sha256": "0" * 64}, "does not match frame_sha256"),
        ({"frame_sha256": "abc"}, "sha256 hex digest"),
        ({"frame_size_bytes": 10}, "descriptor says 10"),
        ({"frame_size_bytes": 10**15}, "descriptor says"),
        ({"total_chunks": "3"}, "'total_chunks' must be a non-negative int"),
        ({"chunk_idx": 99}, "chunk_idx 99 is outside"),
        ({"chunk_idx": -1}, "'chunk_idx' must be a non-negative int"),
        ({"chunk_group_id": 5}, "string 'chunk_group_id'"),
        ({"operation": 5}, "'operation' must be a string"),
    ],
)
def test_bad_descriptors_are_rejected(frame, update, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode_byte_chunks(_rechunk(frame, update))


def test_tampered_payload_fails_the_sha_check(frame):
    chunks = _rechunk(frame, {})
    tampered = bytearray(frame)
    tampered[-1] ^= 0xFF
    bad = _rechunk(bytes(tampered), {"frame_sha256": hashlib.sha256(frame).hexdigest()})
    with pytest.raises(wire.WireError, match="does not match frame_sha256"):
        wire.decode_byte_chunks(chunks[:-1] + bad[-1:])


def test_payload_must_be_uint8_vector(frame):
    desc = {
        "chunk_idx": 0,
        "total_chunks": 1,
        "frame_sha256": hashlib.sha256(frame).hexdigest(),
        "frame_size_bytes": len(frame),
        "chunk_group_id": "g",
    }
    bad = wire.dumps({"payload": np.zeros(3, np.float32)}, metadata={"request_chunk": desc})
    with pytest.raises(wire.WireError, match="no 1-D uint8 payload"):
        wire.decode_byte_chunks([bad])


def test_max_bytes_too_small_is_an_error(frame):
    with pytest.raises(wire.WireError, match="too small"):
        chunks_of(frame, max_bytes=50)


def test_arguments_of_the_wrong_type(frame):
    with pytest.raises(wire.WireError, match="list of chunk frames"):
        wire.decode_byte_chunks(frame)
    with pytest.raises(wire.WireError, match="list of chunk frames"):
        wire.decode_byte_chunks(5)
    with pytest.raises(wire.WireError, match="expects bytes"):
        wire.decode_byte_chunks(["text"])
    with pytest.raises(wire.WireError, match="expects bytes"):
        wire.read_byte_chunk_metadata("text")
    assert wire.read_byte_chunk_metadata(b"garbage") is None
