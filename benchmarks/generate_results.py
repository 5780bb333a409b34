"""Generate results on the wire: tensor columns against JSON, and a real rollout round trip.

(a) Codec, for 256 x 512 and 2048 x 4096 samples with logprobs: the column form
(:mod:`arctic_platform.contract.generate_columns`: flat int32 token ids, float32 logprobs and
int64 offsets) encoded with ``wire.dumps`` and decoded with ``wire.loads``, against
``json.dumps`` / ``json.loads`` of the same values as lists (``token_ids`` and ``logprobs``, one
list per sample), measured in the same run. Reported: encode+decode speed ratio and frame size
ratio (targets: >= 5x faster, frame no larger).

(b) Whole path for 256 x 512, where both forms still fit a frame: from the sampler's per-sample
dicts to the client's per-sample dicts, i.e. ``pack`` + encode + decode + ``unpack`` against the
reference list form inside a DSSST1 frame (its JSON header) — what the client and server did before.

(c) Round trip of a 2048 x 4096 rollout with logprobs through ``client.generate`` over loopback,
on the on-prem route and on the Cortex route (submit, poll, result chunks), against our real
server. Generating that many tokens takes a GPU; here the sampling sub-job's engine is replaced by
``RolloutReplay``, which hands back a prepared rollout, so only the result's way back is timed. In
the reference list form this result does not fit a frame at all (its header passes 64 MiB).

Run: ``python -m benchmarks.generate_results``; writes
``benchmarks/results/generate_results.json``.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from arctic_platform import wire
from arctic_platform.contract import generate_columns as gc
from benchmarks._common import median_seconds, write_result
from tests.live_server import serve_app

VOCAB = 151_000


def rollout_columns(samples: int, length: int) -> dict:
    """The columns of a rollout: ``samples`` completions of ``length`` tokens with logprobs."""
    rng = np.random.default_rng(0)
    total = samples * length
    return {
        "count": samples,
        "token_ids": rng.integers(0, VOCAB, total, dtype=np.int32),
        "token_offsets": np.arange(samples + 1, dtype=np.int64) * length,
        "logprob": np.log(rng.random(total, dtype=np.float32) + 1e-6).astype(np.float32),
        "has_logprobs": np.ones(samples, bool),
        "top_k": np.zeros(samples, np.int32),
        "top_ids": np.zeros(0, np.int32),
        "top_logprobs": np.zeros(0, np.float32),
        "finish_reason": ["length"] * samples,
        "extra": None,
    }


def codec(samples: int, length: int, repeat: int, warmup: int = 1) -> dict:
    columns = rollout_columns(samples, length)
    bounds = columns["token_offsets"].tolist()
    ids, values = columns["token_ids"].tolist(), columns["logprob"].tolist()
    lists = {
        "token_ids": [ids[bounds[i] : bounds[i + 1]] for i in range(samples)],
        "logprobs": [values[bounds[i] : bounds[i + 1]] for i in range(samples)],
    }
    del ids, values
    result = {"job_id": "bench", gc.COLUMNS_KEY: columns}
    frame = wire.dumps(result)
    text = json.dumps(lists)
    decoded = wire.loads(frame)[gc.COLUMNS_KEY]
    assert np.array_equal(decoded["token_ids"], columns["token_ids"])
    assert np.array_equal(decoded["logprob"], columns["logprob"])
    seconds = {
        "columns_encode_decode": median_seconds(
            lambda: wire.loads(wire.dumps(result)), repeat=repeat, warmup=warmup
        ),
        "json_encode_decode": median_seconds(
            lambda: json.loads(json.dumps(lists)), repeat=repeat, warmup=warmup
        ),
    }
    return {
        "samples": samples,
        "tokens_per_sample": length,
        "seconds": seconds,
        "frame_bytes": len(frame),
        "json_bytes": len(text.encode()),
        "speed_vs_json": round(seconds["json_encode_decode"] / seconds["columns_encode_decode"], 1),
        "size_vs_json": round(len(frame) / len(text.encode()), 3),
    }


def sampler_outputs(samples: int, length: int) -> list[dict]:
    """Per-sample dicts as the sampler makes them (logprobs without alternatives)."""
    columns = rollout_columns(samples, length)
    bounds = columns["token_offsets"].tolist()
    ids, values = columns["token_ids"].tolist(), columns["logprob"].tolist()
    out = []
    for i in range(samples):
        span = slice(bounds[i], bounds[i + 1])
        out.append(
            {
                "text": "x" * length,
                "token_ids": ids[span],
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_len": 16,
                "prompt_index": i,
                "sample_index": 0,
                "cached_prompt_tokens": 0,
                "logprobs": [
                    {"token_id": t, "logprob": v, "top": []}
                    for t, v in zip(ids[span], values[span], strict=True)
                ],
            }
        )
    return out


def whole_path(samples: int, length: int, repeat: int) -> dict:
    outputs = sampler_outputs(samples, length)

    def columns_path():
        frame = wire.dumps({"job_id": "bench", **gc.as_columns({"results": outputs})})
        return gc.results_of(wire.loads(frame))

    def reference_path():
        return wire.loads(wire.dumps({"job_id": "bench", "results": outputs}))["results"]

    assert columns_path() == reference_path() == outputs
    seconds = {
        "columns": median_seconds(columns_path, repeat=repeat),
        "reference_frame": median_seconds(reference_path, repeat=repeat),
    }
    return {
        "samples": samples,
        "tokens_per_sample": length,
        "seconds": seconds,
        "speed_vs_reference_frame": round(seconds["reference_frame"] / seconds["columns"], 2),
    }


class RolloutReplay:
    """Stands in for a GPU sampler: ``generate`` returns a prepared rollout (see module doc)."""

    def __init__(self, outputs: list[dict]) -> None:
        self.outputs = outputs

    def generate(self, prompts, sampling_params=None) -> list[dict]:
        return self.outputs


def loopback_round_trip(samples: int, length: int) -> dict:
    from arctic_platform.client import create_arctic_rl_client
    from arctic_platform.server.app import create_app
    from arctic_platform.server.auth import TokenAuth
    from arctic_platform.server.service import Service, ServiceSettings

    outputs = sampler_outputs(samples, length)
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp:
        service = Service(ServiceSettings(data_dir=Path(tmp), device="cpu"))
        app = create_app(service, auth=TokenAuth([]), close_service_on_shutdown=False)
        try:
            with serve_app(app) as url:
                for kind, backend in (
                    ("onprem", {"type": "http", "url": url, "request_timeout": 600}),
                    ("cortex", {"type": "cortex", "base_url": url, "database": "B", "schema": "R"}),
                ):
                    config = {
                        "model": "builtin:tiny",
                        "backend": backend,
                        "sampling": {},
                        "tensor_type": "numpy",
                    }
                    with create_arctic_rl_client(config, blocking_calls=True) as client:
                        sub = service.resolve(client.sampling_job_id, owner=None)
                        sub.engine = RolloutReplay(outputs)
                        started = time.perf_counter()
                        received = client.generate(["1+1="])
                        seconds[kind] = time.perf_counter() - started
                        assert received == outputs, kind
        finally:
            service.close()
    return {"samples": samples, "tokens_per_sample": length, "client_generate_seconds": seconds}


def main() -> None:
    codecs = [codec(256, 512, repeat=5), codec(2048, 4096, repeat=1, warmup=0)]
    path = whole_path(256, 512, repeat=3)
    loopback = loopback_round_trip(2048, 4096)
    targets = {"speed_vs_json": 5.0, "size_vs_json": 1.0}
    met = {
        f"{c['samples']}x{c['tokens_per_sample']}": {
            "speed": c["speed_vs_json"] >= targets["speed_vs_json"],
            "size": c["size_vs_json"] <= targets["size_vs_json"],
        }
        for c in codecs
    }
    write_result(
        "generate_results",
        {
            "codec": codecs,
            "whole_path": path,
            "loopback_2048x4096": loopback,
            "targets": targets,
            "targets_met": met,
        },
    )


if __name__ == "__main__":
    main()
