"""Latency of 16 clients that each send one request at a random time to one sampler.

Run as a script in its own process, so the same file measures any checkout's engine: the
``arctic_platform`` it imports is whichever ``PYTHONPATH`` names (this worktree, or the main
checkout for the engine before continuous batching). Prints one JSON line.

The clients arrive at exponentially spaced times (seeded, so every run sees the same schedule);
each sends one prompt of :data:`PROMPT_LEN` tokens for exactly :data:`NEW_TOKENS` new tokens. The
sampler is driven the way the Service drives it: with ``--serial`` one call at a time in arrival
order (one worker thread per sub-job, the Service before continuous batching), otherwise every
call as it arrives (the Service now lets generates overlap, and they join the running decode).
Latency is a request's finish time minus its arrival time.

Usage: ``PYTHONPATH=<checkout> python benchmarks/sample_clients.py [--serial]``
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import torch

from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.sampler import SamplingEngine

CLIENTS = 16
PROMPT_LEN = 64
NEW_TOKENS = 64
MEAN_GAP_S = 0.25


def main(serial: bool) -> dict:
    torch.manual_seed(0)
    engine = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name="builtin:small")))
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(5, 100, (CLIENTS, PROMPT_LEN), generator=gen).tolist()
    gaps = torch.empty(CLIENTS).exponential_(1 / MEAN_GAP_S, generator=gen).tolist()
    params = {"max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS, "seed": 0}
    engine.generate(prompts[:1], {**params, "max_tokens": 4, "min_tokens": 4})  # warm up
    one_at_a_time = threading.Lock()
    latencies: list[float] = [0.0] * CLIENTS

    def client(i: int, arrival: float) -> None:
        if serial:
            with one_at_a_time:
                engine.generate([prompts[i]], params)
        else:
            engine.generate([prompts[i]], params)
        latencies[i] = time.perf_counter() - arrival

    threads, start = [], time.perf_counter()
    arrival = start
    for i, gap in enumerate(gaps):
        arrival += gap
        time.sleep(max(0.0, arrival - time.perf_counter()))
        thread = threading.Thread(target=client, args=(i, time.perf_counter()))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return {
        "mode": "serial" if serial else "concurrent",
        "clients": CLIENTS,
        "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS,
        "mean_gap_s": MEAN_GAP_S,
        "mean_latency_s": statistics.mean(latencies),
        "median_latency_s": statistics.median(latencies),
        "max_latency_s": max(latencies),
        "wall_s": wall,
        "tokens_per_s": CLIENTS * NEW_TOKENS / wall,
    }


if __name__ == "__main__":
    print(json.dumps(main("--serial" in sys.argv)), flush=True)
