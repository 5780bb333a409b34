"""Chaos against a real ``arctic-platform serve`` process: SIGKILLs mid-work, then malformed input.

(a) Kills. ``--kills`` rounds on one data dir. Each round starts ``serve``, makes a training job
(on-prem ``/initialize``) and a Tinker LoRA training run, acknowledges an on-prem ``save`` and a
Tinker ``save_weights_for_sampler`` of ``s1`` (an overwrite from the second round's run on), then
starts one victim op -- an on-prem save, an overwrite (Tinker ``s1`` again, or an on-prem save at
the same step), a ``generate``, a ``forward-backward`` or a Cortex chunk-group upload -- and sends
SIGKILL after a random delay within the op's expected length. The next start checks, on the same
data dir, that every save acknowledged so far is listed (on-prem: the jobs API's checkpoints;
Tinker: the run's checkpoints), that every checkpoint the killed round's jobs list loads (on-prem:
``load-checkpoint`` by ``checkpoint_id`` into a live job; Tinker: a sampling client on the path
samples), and that no staging (``.tmp-``) or replaced (``.old-``) folder is left on disk.

(b) Fuzz. On the last start, every route (on-prem, Cortex, Tinker, jobs API, OpenAI ``/v1``) gets
``--fuzz-per-route`` malformed bodies each: random bytes, truncated DSSST1 frames, a JSON body
under the wrong content type, huge numbers, deep nesting. Every answer must be below 500 while the
server's RSS (``VmRSS`` of the serve process, polled every 20 ms) stays under ``--rss-bound-mib``.

Any 5xx answered by a live server, in either part, is counted. Goals: 0 saves lost, 0 half-written
folders visible, 0 5xx, peak RSS under the bound.

Run: ``python -m benchmarks.chaos [--kills 8 --fuzz-per-route 6 --seed 0]``; writes
``benchmarks/results/chaos.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from arctic_platform import wire
from benchmarks._common import write_result
from tests.live_server import serve_process
from tests.server.tinker.plain_http import PROTOBUF, TinkerHttp
from tests.server.tinker.test_crash_overwrite import leftovers

TINY = "builtin:tiny"
TOKEN = "chaos-tenant"
TOKENS_ENV = "ARCTIC_CHAOS_TOKENS"
SERVE = ("--token-env", TOKENS_ENV)
ENV = {TOKENS_ENV: TOKEN}
HEADERS = {"authorization": f"Bearer {TOKEN}", "x-api-key": TOKEN}
OCTET = {"content-type": "application/octet-stream"}
CORTEX = "/api/v2/databases/DB/schemas/RL/cortex-training"
VICTIMS = ("save", "overwrite", "generate", "fwd_bwd", "chunk_upload")
PROMPT = [1, 20, 21, 22]


@dataclass
class Tally:
    """What the run saw: answers >= 500 from a live server, RSS samples, losses."""

    server_errors: list[str] = field(default_factory=list)
    peak_rss_mib: float = 0.0
    kills: int = 0
    victims: dict[str, int] = field(default_factory=dict)
    saves_acknowledged: int = 0
    checkpoints_loaded: int = 0
    saves_lost: set[str] = field(default_factory=set)
    unloadable: list[str] = field(default_factory=list)
    half_written_visible: list[str] = field(default_factory=list)

    def seen(self, response: httpx.Response, what: str) -> httpx.Response:
        if response.status_code >= 500:
            self.server_errors.append(f"{what}: {response.status_code} {response.text[:200]}")
        return response


class RssWatch:
    """Polls the serve process's ``VmRSS`` on a thread; ``peak_mib`` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_mib, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            try:
                text = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            for line in text.splitlines():
                if line.startswith("VmRSS:"):
                    self.peak_mib = max(self.peak_mib, int(line.split()[1]) / 1024)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mib


def training_batch(rows: int, seq: int) -> dict:
    ids = np.random.default_rng(0).integers(3, 100, (rows, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}


def fwd_bwd_frame(rows: int = 4, seq: int = 64) -> bytes:
    body = {"batch": training_batch(rows, seq), "processing": {"loss_fn": "cross_entropy"}}
    return wire.dumps(body)


@dataclass
class Ledger:
    """Saves acknowledged so far: on-prem ``(job_id, checkpoint_id)``, Tinker ``(run, path)``."""

    onprem: list[tuple[str, str]] = field(default_factory=list)
    tinker: list[tuple[str, str]] = field(default_factory=list)


def verify(url: str, data: Path, ledger: Ledger, fresh: tuple[str, str], tally: Tally) -> None:
    """After a restart: every acknowledged save listed; every checkpoint of the killed round's
    jobs (``fresh``: its on-prem job and Tinker run) loads; nothing half-written on disk."""
    fresh_job, fresh_run = fresh
    tally.half_written_visible += [str(p.relative_to(data)) for p in leftovers(data)]
    with httpx.Client(base_url=url, headers=HEADERS, timeout=300) as http:
        job = http.post("/initialize", json={"model_name": TINY, "job_type": "training"})
        loader = tally.seen(job, "initialize loader").json()["job_id"]
        listed: dict[str, set[str]] = {}
        for job_id in {j for j, _ in ledger.onprem}:
            answer = tally.seen(http.get(f"/jobs/{job_id}/checkpoints"), "list checkpoints")
            listed[job_id] = {c["checkpoint_id"] for c in answer.json()["checkpoints"]}
        for job_id, checkpoint_id in ledger.onprem:
            if checkpoint_id not in listed[job_id]:
                tally.saves_lost.add(f"on-prem {job_id}/{checkpoint_id}")
        for checkpoint_id in listed.get(fresh_job, ()):
            body = {"checkpoint_id": checkpoint_id, "source_job_id": fresh_job}
            loaded = tally.seen(http.post(f"/load-checkpoint?job_id={loader}", json=body), "load")
            if loaded.status_code != 200:
                tally.unloadable.append(f"on-prem {fresh_job}/{checkpoint_id}: {loaded.text}")
            else:
                tally.checkpoints_loaded += 1
        http.post("/destroy", params={"job_id": loader}, json={})
    client = TinkerHttp(url, TOKEN)
    try:
        runs: dict[str, set[str]] = {}
        for run in {r for r, _ in ledger.tinker}:
            runs[run] = {c["tinker_path"] for c in client.checkpoints(run)}
        for run, path in ledger.tinker:
            if path not in runs[run]:
                tally.saves_lost.add(f"tinker {path}")
        session = client.session()
        for seq, path in enumerate(sorted(runs.get(fresh_run, ()))):
            if "/sampler_weights/" not in path:
                continue
            sampled = tally.seen(client.sample(session, path, PROMPT, seq=seq), "sample")
            if sampled.status_code != 200 or sampled.headers.get("content-type") != PROTOBUF:
                tally.unloadable.append(
                    f"tinker {path}: {sampled.status_code} {sampled.text[:200]}"
                )
            else:
                tally.checkpoints_loaded += 1
    finally:
        client.close()


def victim_op(name: str, url: str, job_id: str, run: str, rng: random.Random) -> Callable[[], None]:
    """The op a round is killed in (module doc); runs on a thread, its errors ignored (the
    server dies under it)."""

    def save() -> None:
        with httpx.Client(base_url=url, headers=HEADERS, timeout=300) as http:
            http.post(f"/step?job_id={job_id}", json={})  # a new step: a new checkpoint
            http.post(f"/save?job_id={job_id}", json={})

    def overwrite() -> None:
        if rng.random() < 0.5:
            client = TinkerHttp(url, TOKEN)
            client.save("save_weights_for_sampler", run, "s1")
            client.close()
        else:
            with httpx.Client(base_url=url, headers=HEADERS, timeout=300) as http:
                http.post(f"/save?job_id={job_id}", json={})  # same step: the same checkpoint

    def generate() -> None:
        with httpx.Client(base_url=url, headers=HEADERS, timeout=300) as http:
            job = http.post("/initialize", json={"model_name": TINY, "job_type": "sampling"})
            params = {"n": 8, "max_tokens": 64, "temperature": 1.0}
            body = wire.dumps({"prompts": ["1+2="] * 4, "sampling_params": params})
            http.post(f"/generate?job_id={job.json()['job_id']}", content=body, headers=OCTET)

    def fwd_bwd() -> None:
        with httpx.Client(base_url=url, headers=HEADERS, timeout=300) as http:
            frame = fwd_bwd_frame(8, 128)
            http.post(f"/forward-backward?job_id={job_id}", content=frame, headers=OCTET)

    def chunk_upload() -> None:
        with httpx.Client(base_url=url, headers=HEADERS, timeout=300) as http:
            spec = {"job_type": "training", "model_name": TINY, "seed": 0}
            created = http.post(CORTEX, json={"sub_job_configs": [spec]}).json()["job_id"]
            frame = fwd_bwd_frame(16, 512)
            chunks = wire.encode_byte_chunks(
                frame, kind="request", operation="forward-backward", max_bytes=16 * 1024
            )
            for chunk in chunks:
                http.post(f"{CORTEX}/{created}/forward-backward", content=chunk, headers=OCTET)

    return {
        "save": save,
        "overwrite": overwrite,
        "generate": generate,
        "fwd_bwd": fwd_bwd,
        "chunk_upload": chunk_upload,
    }[name]


def kill_round(url: str, process, ledger: Ledger, victim: str, rng: random.Random, tally: Tally):
    """One round (module doc): acknowledged saves, then SIGKILL at a random point of ``victim``.
    Returns the round's (on-prem job, Tinker run)."""
    with httpx.Client(base_url=url, headers=HEADERS, timeout=300) as http:
        job = http.post("/initialize", json={"model_name": TINY, "job_type": "training"})
        job_id = tally.seen(job, "initialize").json()["job_id"]
        frame = fwd_bwd_frame()
        tally.seen(
            http.post(f"/forward-backward?job_id={job_id}", content=frame, headers=OCTET), "fb"
        )
        tally.seen(http.post(f"/step?job_id={job_id}", json={}), "step")
        started = time.monotonic()
        saved = tally.seen(http.post(f"/save?job_id={job_id}", json={}), "save")
        save_seconds = time.monotonic() - started
        ledger.onprem.append((parent(job_id), saved.json()["checkpoint_id"]))
    client = TinkerHttp(url, TOKEN)
    run = client.training_run(client.session(), TINY)
    for _ in range(2):  # a save, then an acknowledged overwrite of it
        client.ok(client.save("save_weights_for_sampler", run, "s1").json()["request_id"])
    ledger.tinker.append((run, f"tinker://{run}/sampler_weights/s1"))
    client.close()
    tally.saves_acknowledged += 3
    window = {"save": 2 * save_seconds, "overwrite": save_seconds}.get(victim, 1.0)
    thread = threading.Thread(target=_quietly, args=(victim_op(victim, url, job_id, run, rng),))
    thread.start()
    time.sleep(rng.uniform(0.0, window))
    process.kill()
    process.wait(timeout=60)
    thread.join(timeout=60)
    tally.kills += 1
    tally.victims[victim] = tally.victims.get(victim, 0) + 1
    return parent(job_id), run


def parent(sub_job_id: str) -> str:
    """The job of an on-prem ``/initialize`` answer's sub-job id (``job:kind:index``): what the
    jobs API lists checkpoints of and ``load-checkpoint`` names as ``source_job_id``."""
    return sub_job_id.split(":")[0]


def _quietly(fn: Callable[[], None]) -> None:
    """Run a victim op; what it raises when the server dies under it is expected."""
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        fn()


# -- fuzz ------------------------------------------------------------------------------------


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def malformed_bodies(rng: random.Random, count: int) -> list[tuple[bytes, str]]:
    """``count`` malformed (body, content type) pairs, cycling through the kinds."""
    frame = fwd_bwd_frame()
    kinds = [
        lambda: (rng.randbytes(rng.randint(1, 4096)), "application/json"),
        lambda: (frame[: rng.randint(1, len(frame) - 1)], "application/octet-stream"),
        lambda: (rng.randbytes(rng.randint(1, 4096)), "application/octet-stream"),
        lambda: (json.dumps({"batch": {"input_ids": [[1, 2]]}}).encode(), "text/plain"),
        lambda: (frame, "application/json"),
        lambda: (
            json.dumps(
                {
                    "model_name": TINY,
                    "job_type": "training",
                    "step": 10**30,
                    "max_tokens": 2**63,
                    "num_samples": 10**12,
                    "sampling_params": {"n": 10**18, "max_tokens": 1e308},
                    "lora_config": {"rank": 2**40},
                    "shape": [2**32, 2**32],
                }
            ).encode(),
            "application/json",
        ),
        lambda: (deep(100_000), "application/json"),
        lambda: (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "application/json"),
        lambda: (b"", "application/json"),
        lambda: (b"\x00" * 10_000, "application/x-protobuf"),
    ]
    return [kinds[i % len(kinds)]() for i in range(count)]


def routes(job_id: str, cortex_job: str, run: str) -> list[tuple[str, str]]:
    """(method, path) of every route of the four APIs, on live ids where they take one."""
    onprem_ops = [
        "generate", "forward", "forward-backward", "log-probs", "step", "save", "load-checkpoint",
        "operation", "sleep-inference", "wake-inference", "reset-prefix-cache", "no-such-op",
    ]  # fmt: skip
    tinker = [
        "create_session", "session_heartbeat", "create_model", "get_info", "forward_backward",
        "forward", "optim_step", "load_weights", "save_weights", "save_weights_for_sampler",
        "create_sampling_session", "asample", "retrieve_future", "weights_info", "telemetry",
        "client/config", "sessions/x/finish",
    ]  # fmt: skip
    cortex = [
        "forward-backward", "forward-no-grad", "step", "save", "load", "operation",
        "generate-stream", "generate", "log-probs",
    ]  # fmt: skip
    return [
        ("POST", "/initialize"),
        ("POST", "/destroy"),
        *[("POST", f"/{op}?job_id={job_id}") for op in onprem_ops],
        ("POST", CORTEX),
        *[("POST", f"{CORTEX}/{cortex_job}/{r}") for r in cortex],
        ("POST", f"{CORTEX}/{cortex_job}/checkpoints/x:export"),
        *[("POST", f"/api/v1/{r}") for r in tinker],
        ("PUT", f"/api/v1/training_runs/{run}/checkpoints/sampler_weights/s1/ttl"),
        ("POST", f"/jobs/{job_id}/cancel"),
        ("GET", f"/jobs/{job_id}/logs?cursor=-1&max_lines=99999999999999999999"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
    ]


def fuzz(url: str, per_route: int, rng: random.Random, tally: Tally) -> int:
    """Send ``per_route`` malformed bodies to every route; returns how many were sent."""
    sent = 0
    with httpx.Client(base_url=url, headers=HEADERS, timeout=300) as http:
        job_id = http.post("/initialize", json={"model_name": TINY, "job_type": "training"})
        job_id = tally.seen(job_id, "initialize").json()["job_id"]
        spec = {"job_type": "training", "model_name": TINY, "seed": 0}
        cortex_job = tally.seen(http.post(CORTEX, json={"sub_job_configs": [spec]}), "cortex")
        cortex_job = cortex_job.json()["job_id"]
        client = TinkerHttp(url, TOKEN)
        run = client.training_run(client.session(), TINY)
        client.close()
        for method, path in routes(job_id, cortex_job, run):
            for body, content_type in malformed_bodies(rng, per_route):
                try:
                    response = http.request(
                        method, path, content=body, headers={"content-type": content_type}
                    )
                except httpx.HTTPError as error:  # a dropped connection is a crash too
                    tally.server_errors.append(f"{method} {path}: {type(error).__name__}")
                    continue
                tally.seen(response, f"{method} {path} ({content_type}, {len(body)} B)")
                sent += 1
        # The server still works: a new job trains (the fuzzed one was cancelled by its route).
        job = http.post("/initialize", json={"model_name": TINY, "job_type": "training"})
        frame, job_id = fwd_bwd_frame(), tally.seen(job, "initialize").json()["job_id"]
        after = http.post(f"/forward-backward?job_id={job_id}", content=frame, headers=OCTET)
        if after.status_code != 200:
            tally.server_errors.append(f"after the fuzz: {after.status_code} {after.text[:200]}")
    return sent


def chaos(data: Path, *, kills: int, fuzz_per_route: int, seed: int) -> dict:
    """The benchmark's core (module doc): the figures as a dict."""
    rng = random.Random(seed)
    tally, ledger = Tally(), Ledger()
    fresh: tuple[str, str] | None = None
    fuzz_peak, fuzz_baseline, fuzz_sent = 0.0, 0.0, 0
    started = time.monotonic()
    for round_ in range(kills + 1):
        with serve_process(data, *SERVE, env=ENV) as (process, url):
            watch = RssWatch(process.pid)
            if fresh is not None:
                verify(url, data, ledger, fresh, tally)
            if round_ < kills:
                victim = VICTIMS[round_ % len(VICTIMS)] if round_ < len(VICTIMS) else None
                victim = victim or rng.choice(VICTIMS)
                fresh = kill_round(url, process, ledger, victim, rng, tally)
            else:
                time.sleep(0.1)
                fuzz_baseline = watch.peak_mib
                watch.peak_mib = 0.0
                fuzz_sent = fuzz(url, fuzz_per_route, rng, tally)
                fuzz_peak = watch.peak_mib
            tally.peak_rss_mib = max(tally.peak_rss_mib, watch.stop())
    return {
        "kills": tally.kills,
        "kills_survived": tally.kills,  # every restart came up (serve_process raises if not)
        "victims": tally.victims,
        "saves_acknowledged": tally.saves_acknowledged,
        "saves_lost": len(tally.saves_lost),
        "saves_lost_detail": sorted(tally.saves_lost),
        "checkpoints_loaded_after_kills": tally.checkpoints_loaded,
        "unloadable_listed": tally.unloadable,
        "half_written_visible": tally.half_written_visible,
        "fuzz_requests": fuzz_sent,
        "server_errors_5xx": len(tally.server_errors),
        "server_errors_detail": tally.server_errors[:50],
        "peak_rss_mib": round(tally.peak_rss_mib, 1),
        "fuzz_rss_before_mib": round(fuzz_baseline, 1),
        "fuzz_peak_rss_mib": round(fuzz_peak, 1),
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--fuzz-per-route", type=int, default=10)
    parser.add_argument("--rss-bound-mib", type=float, default=2048.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = chaos(
            Path(tmp) / "data", kills=args.kills, fuzz_per_route=args.fuzz_per_route, seed=args.seed
        )
    figures["rss_bound_mib"] = args.rss_bound_mib
    figures["rss_within_bound"] = figures["peak_rss_mib"] <= args.rss_bound_mib
    write_result("chaos", {"config": vars(args), **figures})


if __name__ == "__main__":
    main()
