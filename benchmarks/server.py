"""Transport overhead of the HTTP APIs, against the same call in process, in the same run.

(a) One ``fwd_bwd`` of a verl-shaped batch (default B=64, S=1024) on ``builtin:small`` (~25 M
parameters), through the client on three backends: ``inprocess``, ``http`` (on-prem API) and
``cortex`` (Cortex API: chunk-group upload, submit, poll with backoff), all against one
``arctic-platform serve`` process started here for the two HTTP backends. Reported as wall-time
ratios to in-process (targets: <= 1.15x on-prem, <= 1.3x Cortex).

(b) Upload of a 256 MiB DSSST1 frame to the on-prem server over loopback, streamed the way the
client streams bodies (1 MiB memoryview pieces of ``wire.dumps_buffers``), timed until the server
has received and decoded the whole frame. The frame is addressed to a sampling job, which refuses
a forward-backward *after* reading and decoding it, so only the transfer is timed. Target >= 1 GB/s.

Run: ``python -m benchmarks.server [--batch 64 --seq 1024 --repeat 2]``; writes
``benchmarks/results/server.json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from arctic_platform import wire
from arctic_platform.client import create_arctic_rl_client
from arctic_platform.client.local_server import LocalServer
from arctic_platform.client.transports.http_common import octet_request
from benchmarks._common import write_result

MODEL = "builtin:small"
UPLOAD_BYTES = 256 * 1024 * 1024


def make_batch(batch: int, seq: int) -> dict:
    rng = np.random.default_rng(0)
    prompt = seq // 4
    mask = np.ones((batch, seq), np.int64)
    response = np.zeros((batch, seq), np.int64)
    response[:, prompt:] = 1
    return {
        "input_ids": rng.integers(3, 100, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
        "position_ids": np.broadcast_to(np.arange(seq), (batch, seq)).copy(),
        "response_mask": response,
        "advantages": (rng.standard_normal((batch, 1)) * response).astype(np.float32),
        "old_log_probs": (-rng.random((batch, seq)) * response).astype(np.float32),
    }


def time_fwd_bwd(backend: dict, payload: dict, repeat: int, data_dir: Path) -> list[float]:
    config = {
        "model": MODEL,
        "seed": 0,
        "backend": backend,
        "training": {"optimizer": {"lr": 1e-5}, "max_tokens_per_microbatch": 16384},
    }
    if backend["type"] == "inprocess":
        config["backend"] = {**backend, "data_dir": str(data_dir), "device": "cpu"}
    with create_arctic_rl_client(config, blocking_calls=True) as client:
        client.fwd_bwd(payload)  # warm-up: first call allocates and faults in memory
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            client.fwd_bwd(payload)
            times.append(time.perf_counter() - started)
    return times


def upload(url: str) -> dict:
    with httpx.Client(base_url=url, timeout=600) as http:
        job = http.post("/initialize", json={"model_name": "builtin:tiny", "job_type": "sampling"})
        job_id = job.json()["job_id"]
        frame = {"batch": {"payload": np.ones(UPLOAD_BYTES // 4, np.float32)}}
        seconds = []
        for _ in range(4):
            pieces, headers = octet_request(wire.dumps_buffers(frame))
            started = time.perf_counter()
            reply = http.post(f"/forward-backward?job_id={job_id}", content=pieces, headers=headers)
            seconds.append(time.perf_counter() - started)
            assert reply.status_code == 400 and "wrong_job_type" in reply.text, reply.text
    best = min(seconds[1:])
    return {"frame_bytes": UPLOAD_BYTES, "seconds": seconds, "gb_per_s": UPLOAD_BYTES / best / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    payload = {"batch": make_batch(args.batch, args.seq), "processing": {"loss_fn": "verl_grpo"}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = LocalServer(
            data_dir=root / "server", device="cpu", extra_args=("--max-body-mb", "512")
        )
        with server as url:
            upload_result = upload(url)
            times = {
                "inprocess": time_fwd_bwd({"type": "inprocess"}, payload, args.repeat, root / "ip"),
                "http": time_fwd_bwd({"type": "http", "url": url}, payload, args.repeat, root),
                "cortex": time_fwd_bwd(
                    {"type": "cortex", "base_url": url, "database": "BENCH", "schema": "RL"},
                    payload,
                    args.repeat,
                    root,
                ),
            }
    median = {k: float(np.median(v)) for k, v in times.items()}
    ratios = {
        "onprem_vs_inprocess": round(median["http"] / median["inprocess"], 3),
        "cortex_vs_inprocess": round(median["cortex"] / median["inprocess"], 3),
    }
    write_result(
        "server",
        {
            "model": MODEL,
            "batch": {"B": args.batch, "S": args.seq},
            "fwd_bwd_seconds": times,
            "fwd_bwd_median_seconds": median,
            "ratios": ratios,
            "upload_256MiB": upload_result,
            "targets": {
                "onprem_vs_inprocess": 1.15,
                "cortex_vs_inprocess": 1.3,
                "upload_gb_s": 1.0,
            },
            "targets_met": {
                "onprem": ratios["onprem_vs_inprocess"] <= 1.15,
                "cortex": ratios["cortex_vs_inprocess"] <= 1.3,
                "upload": upload_result["gb_per_s"] >= 1.0,
            },
        },
    )


if __name__ == "__main__":
    main()
