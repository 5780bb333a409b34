"""Mutation fuzzing: corrupted frames and chunks only ever raise WireError, and fast."""

from __future__ import annotations

import contextlib
import json
import random
import struct

import numpy as np
import pytest

from arctic_platform import wire

MUTATED_FRAMES = 24_000


def seed_frames() -> list[bytes]:
    rng = np.random.default_rng(0)
    objects = [
        {"input_ids": rng.integers(0, 100, (2, 5)), "adv": rng.standard_normal(5).astype("f4")},
        {"prompts": ["hi", "there"], "sampling_params": {"n": 2, "stop": ["\n"]}},
        ({"a": [np.ones(3, np.int8), (1, 2.5, None)]}, np.float32(2.0)),
        np.arange(4, dtype=np.uint16),
    ]
    frames = [wire.dumps(obj, metadata={"op": "x"}) for obj in objects]
    frames += wire.encode_byte_chunks(frames[0], kind="request", max_bytes=600)
    return frames


def mutate_structure(frame: bytes, rng: random.Random) -> bytes:
    """Corrupt the structure tree while keeping the safetensors layer valid."""
    size = struct.unpack("<Q", frame[:8])[0]
    header = json.loads(frame[8 : 8 + size])
    text = list(header["__metadata__"]["dss"])
    for _ in range(rng.randint(1, 3)):
        text[rng.randrange(len(text))] = rng.choice('[]{}",:0tjdlu1x ')
    header["__metadata__"]["dss"] = "".join(text)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + frame[8 + size :]


def mutate(frame: bytes, rng: random.Random) -> bytes:
    data = bytearray(frame)
    choice = rng.randrange(8)
    if choice == 7:
        return mutate_structure(frame, rng)
    if choice == 0:  # flip bytes anywhere
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif choice == 1:  # flip bytes inside the JSON header, where the structure lives
        size = struct.unpack("<Q", frame[:8])[0]
        for _ in range(rng.randint(1, 3)):
            data[8 + rng.randrange(size)] = rng.choice(b'{}[]",:0123456789aeltdju \\')
    elif choice == 2:  # truncate
        del data[rng.randrange(len(data)) :]
    elif choice == 3:  # append junk
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif choice == 4:  # rewrite the length prefix
        data[:8] = struct.pack("<Q", rng.choice([0, 1, len(data), 2**63, rng.randrange(2**20)]))
    elif choice == 5:  # delete a slice
        start = rng.randrange(len(data))
        del data[start : start + rng.randint(1, 32)]
    else:  # duplicate a slice
        start = rng.randrange(len(data))
        data[start:start] = data[start : start + rng.randint(1, 32)]
    return bytes(data)


def test_mutated_frames_only_raise_wire_error():
    rng = random.Random(1234)
    frames = seed_frames()
    decoded = rejected = 0
    for i in range(MUTATED_FRAMES):
        mutated = mutate(frames[i % len(frames)], rng)
        try:
            wire.loads(mutated)
            wire.read_metadata(mutated)
            wire.read_byte_chunk_metadata(mutated)
            decoded += 1
        except wire.WireError:
            rejected += 1
    assert decoded + rejected == MUTATED_FRAMES
    assert rejected > MUTATED_FRAMES // 2  # the mutations do hit the parser


def test_mutated_chunk_groups_only_raise_wire_error():
    rng = random.Random(99)
    frame = wire.dumps({"w": np.arange(400, dtype=np.float32)})
    chunks = wire.encode_byte_chunks(frame, kind="request", max_bytes=700)
    for _ in range(2_000):
        group = list(chunks)
        index = rng.randrange(len(group))
        group[index] = mutate(group[index], rng)
        if rng.random() < 0.3:
            rng.shuffle(group)
        with contextlib.suppress(wire.WireError):
            assert wire.decode_byte_chunks(group) == frame


def reshaped(frame: bytes, key: str, shape: list[int]) -> bytes:
    """``frame`` with tensor ``key`` declared as ``shape`` (same bytes, same offsets)."""
    size = struct.unpack("<Q", frame[:8])[0]
    header = json.loads(frame[8 : 8 + size])
    header[key]["shape"] = shape
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + frame[8 + size :]


def random_shape(rng: random.Random, count: int) -> list[int]:
    """A shape of 0..70 dims whose element count is ``count``, or one with a huge zero-size dim."""
    if count == 0:
        dims = [
            rng.choice([0, 1, 7, 2**31, 2**62, 2**63 - 1, 2**63]) for _ in range(rng.randint(1, 4))
        ]
        dims[rng.randrange(len(dims))] = 0
        return dims + [1] * rng.choice([0, 0, 40, 70])
    dims = [count] + [1] * rng.choice([0, 1, 5, 31, 32, 33, 63, 64, 65, 70])
    rng.shuffle(dims)
    return dims


def test_frames_whose_shapes_change_but_not_their_byte_count_raise_wire_error():
    rng = random.Random(7)
    frame = wire.dumps({"w": np.arange(24, dtype=np.float32), "e": np.zeros((0, 3), np.float32)})
    outcomes = {"decoded": 0, "rejected": 0}
    for i in range(2_000):
        key, count = ("w", 24) if i % 2 else ("e", 0)
        mutated = reshaped(frame, key, random_shape(rng, count))
        for tensor_type in ("numpy", "torch"):
            try:
                wire.loads(mutated, tensor_type=tensor_type)
                outcomes["decoded"] += 1
            except wire.WireError:
                outcomes["rejected"] += 1
    assert outcomes["decoded"] and outcomes["rejected"]  # both kinds of shape were generated
    for shape in ([24] + [1] * 64, [2**63, 0], [0, 2**63], [2**62, 2**62, 0]):
        key = "w" if shape[0] == 24 else "e"
        with pytest.raises(wire.WireError, match="shape"):
            wire.loads(reshaped(frame, key, shape))
