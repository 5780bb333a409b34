"""The Ray backend: training step throughput with 1 and 2 workers, and object-store bandwidth.

(a) **steps**: ``fwd_bwd`` + ``step`` (``verl_grpo``, AdamW) on one fixed batch through the client,
    on four configurations alive at once and alternated iteration by iteration (``--warmup``
    discarded, then ``--repeat`` timed rounds; medians), so load drift on a shared machine slows
    all alike:

    * ``inprocess_1_thread`` / ``inprocess_2_threads``: the engine in this process (the baseline);
    * ``ray_1_worker``: one Ray training actor (Ray gives an actor with a fractional CPU one
      OpenMP thread), i.e. the in-process work plus the Ray transport;
    * ``ray_2_workers_ddp``: two actors, half the rows each, gradients all-reduced with gloo.

    Throughput is trained tokens per second; ratios are against ``inprocess_1_thread`` (and
    ``inprocess_2_threads`` for the 2-worker case, which uses both cores too). On a 2-core machine
    two workers cannot beat one process using both cores: the numbers say what the transport and
    the all-reduce cost, not what more devices would gain.

(b) **object store**: a 256 MiB float32 batch ``ray.put`` from the driver, then ``ray.get`` in an
    actor (zero-copy: only a mapping, so its "GB/s" is not a transfer rate; and with a copy into
    the actor's own buffer so every byte moves), against ``numpy.copyto`` of the same bytes in
    this process (both targets allocated up front); GB/s and ratios to the memcpy.

Run: ``python -m benchmarks.ray`` (``--help`` for sizes). Writes ``benchmarks/results/ray.json``
and prints it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from benchmarks._common import write_result

MODEL = "builtin:small"
STEP_CONFIGS = ("inprocess_1_thread", "inprocess_2_threads", "ray_1_worker", "ray_2_workers_ddp")


def fixed_batch(rows: int, prompt: int, response: int, seed: int) -> dict:
    """Equal-length rows (prompt then response), old log-probs near the model's own."""
    import numpy as np

    rng = np.random.default_rng(seed)
    width = prompt + response
    response_mask = np.zeros((rows, width), np.int64)
    response_mask[:, prompt:] = 1
    return {
        "input_ids": rng.integers(5, 100, (rows, width)),
        "attention_mask": np.ones((rows, width), np.int64),
        "response_mask": response_mask,
        "advantages": (rng.normal(size=(rows, 1)) * response_mask).astype(np.float32),
        "old_log_probs": np.full((rows, width), -4.6, np.float32) * response_mask,
    }


def client_for(config: str, data_dir: str):
    from arctic_platform.client import create_arctic_rl_client

    if config.startswith("inprocess"):
        backend = {"type": "inprocess", "data_dir": data_dir, "device": "cpu"}
    else:
        workers = 2 if "2_workers" in config else 1
        backend = {
            "type": "ray",
            "data_dir": data_dir,
            "device": "cpu",
            "num_training_workers": workers,
        }
    return create_arctic_rl_client(
        {"model": MODEL, "seed": 1, "tensor_type": "numpy", "backend": backend},
        blocking_calls=True,
    )


def bench_steps(args) -> dict:
    import torch

    batch = fixed_batch(args.rows, args.prompt, args.response, seed=0)
    body = {"batch": batch, "processing": {"loss_fn": "verl_grpo"}}
    tokens = int(batch["response_mask"].sum())
    threads = {"inprocess_1_thread": 1, "inprocess_2_threads": 2}
    times: dict[str, list[float]] = {name: [] for name in STEP_CONFIGS}
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        clients = {name: client_for(name, f"{root}/{name}") for name in STEP_CONFIGS}
        startup = time.perf_counter() - started
        try:
            for round_ in range(args.warmup + args.repeat):
                for name, client in clients.items():
                    torch.set_num_threads(threads.get(name, 1))
                    start = time.perf_counter()
                    client.fwd_bwd(body)
                    client.step()
                    if round_ >= args.warmup:
                        times[name].append(time.perf_counter() - start)
        finally:
            for client in clients.values():
                client.shutdown()
    medians = {name: statistics.median(values) for name, values in times.items()}
    per_second = {name: tokens / seconds for name, seconds in medians.items()}
    base, both_cores = per_second["inprocess_1_thread"], per_second["inprocess_2_threads"]
    return {
        "model": MODEL,
        "rows": args.rows,
        "trained_tokens_per_step": tokens,
        "tokens_per_row": args.prompt + args.response,
        "clients_startup_seconds": startup,
        "configs": {
            name: {
                "median_seconds": medians[name],
                "all_seconds": times[name],
                "trained_tokens_per_second": per_second[name],
            }
            for name in STEP_CONFIGS
        },
        "ratio_ray_1_worker_vs_inprocess_1_thread": per_second["ray_1_worker"] / base,
        "ratio_ray_2_workers_vs_inprocess_1_thread": per_second["ray_2_workers_ddp"] / base,
        "ratio_ray_2_workers_vs_inprocess_2_threads": per_second["ray_2_workers_ddp"] / both_cores,
        "ratio_ray_2_workers_vs_ray_1_worker": per_second["ray_2_workers_ddp"]
        / per_second["ray_1_worker"],
    }


class _Receiver:
    """An actor that fetches an array from the object store, and optionally copies it into a
    buffer of its own (allocated and touched up front, like the driver's memcpy target)."""

    def __init__(self, size: int) -> None:
        import numpy as np

        self.buffer = np.ones(size // 4, np.float32)

    def fetch(self, refs: list, copy: bool) -> float:
        import numpy as np
        import ray

        start = time.perf_counter()
        array = ray.get(refs[0])
        if copy:
            np.copyto(self.buffer[: array.size], array)
        return time.perf_counter() - start


def bench_object_store(args) -> dict:
    import numpy as np
    import ray

    size = args.mib * 1024 * 1024
    source = np.random.default_rng(0).random(size // 8).astype(np.float64).view(np.float32)
    target = np.empty_like(source)
    receiver = ray.remote(num_cpus=0)(_Receiver).remote(size)
    ray.get(receiver.fetch.remote([ray.put(np.zeros(1))], True))  # actor up before timing
    memcpy, put, get_mapped, get_copied = [], [], [], []
    for round_ in range(args.warmup + args.store_repeat):
        start = time.perf_counter()
        np.copyto(target, source)
        copy_seconds = time.perf_counter() - start
        start = time.perf_counter()
        ref = ray.put(source)
        put_seconds = time.perf_counter() - start
        mapped = ray.get(receiver.fetch.remote([ref], False))
        copied = ray.get(receiver.fetch.remote([ref], True))
        del ref
        if round_ >= args.warmup:
            memcpy.append(copy_seconds)
            put.append(put_seconds)
            get_mapped.append(mapped)
            get_copied.append(copied)
    ray.kill(receiver)

    def rate(values: list[float]) -> float:
        return size / statistics.median(values) / 1e9

    baseline = rate(memcpy)
    return {
        "bytes": size,
        "memcpy_gb_per_s": baseline,
        "put_gb_per_s": rate(put),
        "get_in_actor_zero_copy_gb_per_s": rate(get_mapped),
        "get_in_actor_with_copy_gb_per_s": rate(get_copied),
        "ratio_put_vs_memcpy": rate(put) / baseline,
        "ratio_get_with_copy_vs_memcpy": rate(get_copied) / baseline,
        "seconds": {
            "memcpy": memcpy,
            "put": put,
            "get_zero_copy": get_mapped,
            "get_with_copy": get_copied,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--store-repeat", type=int, default=5)
    args = parser.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = {
            "note": (
                "steps: fwd_bwd + step through the client, configurations alternated per round "
                "(medians); Ray actors with a fractional CPU run one OpenMP thread each; on this "
                "2-core machine 2 workers share the same 2 cores the in-process baseline uses. "
                "object store: ray.put from the driver, ray.get in an actor (zero-copy, and with "
                "a full copy), vs numpy.copyto in the driver"
            ),
            "settings": vars(args),
            "steps": bench_steps(args),
            "object_store": bench_object_store(args),
        }
    finally:
        ray.shutdown()
    write_result("ray", result)


if __name__ == "__main__":
    main()
