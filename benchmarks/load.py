"""A shared server under load: latency and throughput with 1, 4 and 16 concurrent clients, and
server memory over many job create/destroy cycles.

One ``arctic-platform serve`` process (started here) with four tenant tokens; each tenant has a
``builtin:tiny`` job with sampling and log-prob sub-jobs. ``C`` client threads (tenant ``i % 4``)
each run a fixed mix of ops over the on-prem API: ``generate`` (2 prompts x n=2, 8 tokens),
``log-probs`` and ``forward`` (no grad) on the log-prob sub-job. Reported per concurrency: p50 and
p99 op latency and ops/s, as ratios to one client in the same run. Then ``--cycles`` jobs are
created, waited for and cancelled one after another, and the server's RSS growth is reported.

Run: ``nice python -m benchmarks.load [--ops 24 --cycles 200]``; writes
``benchmarks/results/load.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from arctic_platform import wire
from arctic_platform.client.local_server import LocalServer
from benchmarks._common import write_result

MODEL = "builtin:tiny"
TENANTS = [f"load-tenant-{i}" for i in range(4)]
CORTEX = "/api/v2/databases/DB/schemas/RL/cortex-training"
OCTET = {"content-type": "application/octet-stream"}
GENERATE = wire.dumps({"prompts": ["1+2=", "3+4="], "sampling_params": {"n": 2, "max_tokens": 8}})
FORWARD = wire.dumps(
    {
        "batch": {
            "input_ids": np.arange(5, 11)[None],
            "attention_mask": np.ones((1, 6), np.int64),
            "position_ids": np.arange(6)[None],
        }
    }
)


def client(url: str, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {tenant}"}, timeout=600)


def create_job(http: httpx.Client, kinds: tuple[str, ...]) -> str:
    specs = [{"job_type": k, "model_name": MODEL, "seed": 0} for k in kinds]
    job_id = http.post(CORTEX, json={"sub_job_configs": specs}).json()["job_id"]
    deadline = time.monotonic() + 600
    while (status := http.get(f"{CORTEX}/{job_id}").json()["status"]) != "running":
        if status in ("failed", "cancelled", "terminated") or time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} is {status}")
        time.sleep(0.05)
    return job_id


def one_op(http: httpx.Client, job_id: str, i: int) -> None:
    if i % 3 == 0:
        route = f"/generate?job_id={job_id}:sampling:0"
        response = http.post(route, content=GENERATE, headers=OCTET)
    elif i % 3 == 1:
        body = {"prompts": ["1+2="], "completions": ["3"]}
        response = http.post(f"/log-probs?job_id={job_id}:log_prob:0", json=body)
    else:
        route = f"/forward?job_id={job_id}:log_prob:0"
        response = http.post(route, content=FORWARD, headers=OCTET)
    response.raise_for_status()


def run_clients(url: str, jobs: dict[str, str], concurrency: int, ops: int) -> dict:
    latencies: list[float] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        tenant = TENANTS[index % len(TENANTS)]
        with client(url, tenant) as http:
            for i in range(ops):
                start = time.perf_counter()
                one_op(http, jobs[tenant], i + index)
                with lock:
                    latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "clients": concurrency,
        "ops": len(latencies),
        "p50_s": statistics.median(latencies),
        "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "ops_per_s": len(latencies) / elapsed,
    }


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, default=24, help="ops per client per concurrency")
    parser.add_argument("--cycles", type=int, default=200, help="job create/destroy cycles")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    os.environ["ARCTIC_LOAD_TOKENS"] = ",".join(TENANTS)
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalServer(
            host="127.0.0.1",
            port=0,
            data_dir=Path(tmp),
            device="cpu",
            token_env="ARCTIC_LOAD_TOKENS",
            startup_timeout=300,
        )
        url = server.start()
        try:
            jobs = {}
            for tenant in TENANTS:
                with client(url, tenant) as http:
                    jobs[tenant] = create_job(http, ("sampling", "log_probability"))
            for tenant in TENANTS:  # warm every engine once
                with client(url, tenant) as http:
                    for i in range(3):
                        one_op(http, jobs[tenant], i)
            runs = [run_clients(url, jobs, c, args.ops) for c in args.concurrency]
            base = runs[0]
            for run in runs:
                run["p50_ratio"] = run["p50_s"] / base["p50_s"]
                run["p99_ratio"] = run["p99_s"] / base["p99_s"]
                run["throughput_ratio"] = run["ops_per_s"] / base["ops_per_s"]
            pid = server.pid
            for tenant, job_id in jobs.items():
                with client(url, tenant) as http:
                    http.post(f"{CORTEX}/{job_id}:cancel").raise_for_status()
            with client(url, TENANTS[0]) as http:
                before = rss_bytes(pid)
                for _ in range(args.cycles):
                    job_id = create_job(http, ("sampling",))
                    http.post(f"{CORTEX}/{job_id}:cancel").raise_for_status()
                after = rss_bytes(pid)
        finally:
            server.stop()
    write_result(
        "load",
        {
            "model": MODEL,
            "tenants": len(TENANTS),
            "ops_per_client": args.ops,
            "concurrency": runs,
            "job_cycles": args.cycles,
            "rss_before_mb": round(before / 2**20, 1),
            "rss_after_mb": round(after / 2**20, 1),
            "rss_growth_mb": round((after - before) / 2**20, 1),
        },
    )


if __name__ == "__main__":
    main()
