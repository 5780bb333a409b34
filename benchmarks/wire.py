"""DSSST1 codec throughput against memcpy baselines measured in the same run.

Payloads: (a) a verl-shaped training batch (B=256, S=4096: int64 input_ids, attention_mask and
position_ids; float32 advantages and old log-probs) and (b) one 1 GiB float32 tensor. For each,
encode (``wire.dumps`` to bytes), decode (``wire.loads``, zero-copy) and a round trip, in GB/s of
tensor bytes, beside:

* ``memcpy_warm``: ``numpy.copyto`` of the same bytes (each tensor's own memory, read through a
  numpy view) into one existing array;
* ``memcpy_fresh``: ``numpy.empty`` + the same ``copyto`` calls (pays first-touch page faults like
  any new buffer).

The baselines read the tensors' own memory rather than a numpy copy of it: where the source lies
changes copy speed (numpy backs large arrays with huge pages, torch does not), and the codec reads
the tensors where they are.
* ``safetensors``: the ``safetensors`` library's own save/load of the same tensors, for scale.

Targets (issue 2): decode >= 5x memcpy_warm, encode >= 0.8x memcpy_fresh.
Run: ``python -m benchmarks.wire`` (writes ``benchmarks/results/wire.json``).
"""

from __future__ import annotations

import gc

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from arctic_platform import wire
from benchmarks._common import median_seconds, write_result

GB = 1e9


def verl_batch(batch: int = 256, seq: int = 4096) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 150_000, (batch, seq), generator=generator),
        "attention_mask": torch.ones(batch, seq, dtype=torch.int64),
        "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
        "advantages": torch.randn(batch, seq, generator=generator),
        "old_log_probs": torch.randn(batch, seq, generator=generator),
    }


def measure(name: str, payload: dict[str, torch.Tensor], repeat: int) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in payload.values())
    sources = [t.reshape(-1).view(torch.uint8).numpy() for t in payload.values()]
    target = np.empty(nbytes, dtype=np.uint8)

    def copy_into(out: np.ndarray) -> None:
        offset = 0
        for source in sources:
            np.copyto(out[offset : offset + source.nbytes], source)
            offset += source.nbytes

    frame = wire.dumps(payload)
    st_frame = st_save(payload)
    seconds = {
        "memcpy_warm": median_seconds(lambda: copy_into(target), repeat=repeat),
        "memcpy_fresh": median_seconds(
            lambda: copy_into(np.empty(nbytes, dtype=np.uint8)), repeat=repeat
        ),
        "encode": median_seconds(lambda: wire.dumps(payload), repeat=repeat),
        "decode": median_seconds(lambda: wire.loads(frame, tensor_type="torch"), repeat=repeat),
        "round_trip": median_seconds(
            lambda: wire.loads(wire.dumps(payload), tensor_type="torch"), repeat=repeat
        ),
        "safetensors_save": median_seconds(lambda: st_save(payload), repeat=repeat),
        "safetensors_load": median_seconds(lambda: st_load(st_frame), repeat=repeat),
    }
    decoded = wire.loads(frame, tensor_type="torch")
    assert all(torch.equal(decoded[k], v) for k, v in payload.items())
    gbps = {k: nbytes / v / GB for k, v in seconds.items()}
    warm, fresh = gbps["memcpy_warm"], gbps["memcpy_fresh"]
    return {
        "payload": name,
        "tensor_bytes": nbytes,
        "frame_bytes": len(frame),
        "gb_per_s": {k: round(v, 3) for k, v in gbps.items()},
        "ratios": {
            "decode_vs_memcpy_warm": round(gbps["decode"] / warm, 2),
            "encode_vs_memcpy_fresh": round(gbps["encode"] / fresh, 3),
            "encode_vs_memcpy_warm": round(gbps["encode"] / warm, 3),
            "round_trip_vs_memcpy_fresh": round(gbps["round_trip"] / fresh, 3),
            "memcpy_fresh_vs_warm": round(fresh / warm, 3),
            "safetensors_save_vs_memcpy_warm": round(gbps["safetensors_save"] / warm, 3),
            "safetensors_load_vs_memcpy_warm": round(gbps["safetensors_load"] / warm, 3),
        },
    }


def main() -> None:
    results = [measure("verl_batch_256x4096", verl_batch(), repeat=9)]
    gc.collect()
    big = {"weights": torch.randn(256 * 1024 * 1024, generator=torch.Generator().manual_seed(1))}
    results.append(measure("float32_1GiB", big, repeat=3))
    targets = {"decode_vs_memcpy_warm": 5.0, "encode_vs_memcpy_fresh": 0.8}
    met = {r["payload"]: {k: r["ratios"][k] >= v for k, v in targets.items()} for r in results}
    write_result("wire", {"results": results, "targets": targets, "targets_met": met})


if __name__ == "__main__":
    main()
