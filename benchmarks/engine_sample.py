"""SamplingEngine throughput and weight-sync speed, against transformers' generate in the same run.

Model ``builtin:small`` (~25 M parameters, float32 on CPU), same weights for both sides.

(a) ``throughput``: 32 prompts of 64 tokens, 128 sampled tokens each (temperature 1, no top-k or
    top-p; ``min_tokens``/``min_new_tokens`` = 128 so both produce exactly 32 x 128 tokens).
    Generated tokens per second, ours / ``model.generate``. Target >= 1.0.
(b) ``prefix_sharing``: 2 prompts of 512 tokens, n = 8 samples each, 64 new tokens. Ours prefills
    each prompt once; the baseline is ``model.generate`` on the prompts repeated 8 times.
    Target >= 1.5.
    (a) and (b) send new prompts every turn (:func:`_new_prompts`), so our prompt cache is not
    what they measure.
(c) ``weight_sync``: the model's weight bytes per second from a separate trainer model into the
    engine: in process (``sync_in_process``), through the safetensors chunk stream in one process,
    and streamed over a pipe to a receiving process that loads them into its own SamplingEngine
    (timed from the first byte sent to the receiver's acknowledgement, after it was ready).

(e) ``concurrent_clients``: 16 clients, each sending one request (a 64-token prompt, 128 sampled
    tokens) at a random time (seeded, uniform over 3 s); each request's latency from its send to
    its result. The running batch (``continuous_batching: true``, the default: a request joins
    the decode under way) against the same engine taking calls one at a time (``false``, the
    behaviour before the running batch). Ratios are one-at-a-time / running batch, for the mean
    and the 90th percentile latency, from the better of two alternating runs each.

(g) ``multi_turn``: 16 rollouts of 4 turns; a turn's prompt is the last turn's prompt, its
    completion (32 tokens, a seed per rollout) and a new 64-token observation, from 256 tokens
    to 544 (:data:`MULTI_TURN`). Generated tokens per second over the turns' generate calls, our
    engine (its prompt cache reuses each last prompt, a prefix hit, and from the third turn the
    last completion too) against the same engine with the cache off (``prompt_cache_bytes: 0``)
    and ``model.generate``; new prompts every run.

(d) ``--vllm`` (needs ``$ARCTIC_VLLM_PYTHON``, see README "vLLM sampling engine"): the vLLM engine
    beside ours and ``model.generate`` on the workloads of (a) and (b) with the same prompts
    every turn (the issue's workloads: from the second turn on, vLLM's prefix caching and our
    prompt cache skip the prefill), on (b) with new prompts every turn (neither cache helps), and
    on (b)'s new prompts sent as SkyRL sends them, each prompt as 8 requests of n = 1
    (:data:`VLLM_WORKLOADS`), and on (g) (vLLM's prefix caching reuses each turn's prompt and
    completion blocks); startup to the first token
    (engine construction plus a one-token generate) for both engines, and the time of one weight
    sync into the vLLM engine by ``reload`` and by ``restart``. Written to
    ``benchmarks/results/engine_sample_vllm.json``.

(f) ``--vllm --real-vocab``: (d) on the Qwen3-architecture model with the real 151,936-token
    vocabulary (4 layers, hidden 1024, ~0.2 B parameters, float32, built locally by
    ``benchmarks/local_qwen3.py``): 4 new 256-token prompts a turn, n = 4, 64 new tokens (the
    issue's real-size sampling shape), and the weight syncs. Written to
    ``benchmarks/results/engine_sample_vllm_real_vocab.json``.

Runs alternate baseline and engine so background load hits both alike; the ratios use the best
of the alternating runs (medians are reported too), and sync speeds the best of three.
Run: ``python -m benchmarks.engine_sample`` (writes ``benchmarks/results/engine_sample.json``).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.engine.sampler import SamplingEngine
from arctic_platform.engine.weights import (
    iter_weights_from_chunks,
    stream_weights,
    sync_in_process,
)
from benchmarks._common import write_result

MODEL = ModelConfig(name="builtin:small")
CHUNK_BYTES = 16 * 1024 * 1024
REPEAT = 3
# The vLLM comparison's margins (its targets are 0.9x and 1.2x) are near this shared machine's
# run-to-run noise, so each side gets more turns there; the best turn is the least disturbed.
VLLM_REPEAT = 5
MB = 1e6


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _alternate(baseline, ours, repeat: int = REPEAT) -> dict:
    """Run baseline and engine in turns; median and best seconds of each.

    On a shared machine another process can slow any single run several-fold; the best of the
    alternating runs is the figure least disturbed by it, so the ratio is taken from the best
    runs and the medians are reported beside it.
    """
    base_times, our_times = [], []
    for _ in range(repeat):
        base_times.append(_timed(baseline))
        our_times.append(_timed(ours))
    return {
        "generate_s": min(base_times),
        "engine_s": min(our_times),
        "generate_median_s": statistics.median(base_times),
        "engine_median_s": statistics.median(our_times),
    }


def _speed(times: dict, tokens: int, target: float) -> dict:
    return {
        "generate_tokens_per_s": tokens / times["generate_s"],
        "engine_tokens_per_s": tokens / times["engine_s"],
        "ratio": times["generate_s"] / times["engine_s"],
        "ratio_of_medians": times["generate_median_s"] / times["engine_median_s"],
        "target": target,
        **times,
    }


def _plain_model(model: ModelConfig = MODEL):
    """The baseline's model: transformers' own, without the sampler's changes to its forward
    (packed CPU linear layers, the shared-prefix attention); the same weights as the engine's."""
    return load_causal_lm(model).eval().requires_grad_(False)


def _hf_generate(model, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    assert out.shape[1] - input_ids.shape[1] == new_tokens
    return out


def _ours(
    engine: SamplingEngine,
    prompts: list[list[int]],
    n: int,
    new_tokens: int,
    seed_each: bool = False,
):
    """``generate`` with seed 0, or (``seed_each``) seed ``i`` for the ``i``-th prompt, as a
    caller sending each sample as its own request gives them."""
    params = {"n": n, "max_tokens": new_tokens, "min_tokens": new_tokens, "seed": 0}
    if seed_each:
        params = [dict(params, seed=i) for i in range(len(prompts))]
    outs = engine.generate(prompts, params)
    assert all(len(o["token_ids"]) == new_tokens for o in outs)
    return outs


def _new_prompts(shape: tuple[int, int], seed: int, turns: int = REPEAT) -> list[torch.Tensor]:
    """A batch of random prompts per turn. Each turn of a comparison brings new prompts, as each
    RL step does, so no side reuses an earlier turn's prefill (our prompt cache, vLLM's prefix
    caching); the vLLM comparison also runs the issue's workloads with the same prompts every
    turn, where both caches do."""
    gen = _gen(seed)
    return [torch.randint(5, 100, shape, generator=gen) for _ in range(turns)]


def bench_throughput(engine: SamplingEngine, plain) -> dict:
    batch, prompt_len, new_tokens = 32, 64, 128
    warm = torch.randint(5, 100, (2, prompt_len), generator=_gen(11))
    _ours(engine, warm.tolist(), 1, 4)  # warm up both paths
    _hf_generate(plain, warm, 4)
    theirs, mine = (iter(_new_prompts((batch, prompt_len), seed=1)) for _ in range(2))
    times = _alternate(
        lambda: _hf_generate(plain, next(theirs), new_tokens),
        lambda: _ours(engine, next(mine).tolist(), 1, new_tokens),
    )
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        **_speed(times, batch * new_tokens, target=1.0),
    }


def bench_prefix_sharing(engine: SamplingEngine, plain) -> dict:
    prompts_n, n, prompt_len, new_tokens = 2, 8, 512, 64
    theirs, mine = (iter(_new_prompts((prompts_n, prompt_len), seed=2)) for _ in range(2))
    times = _alternate(
        lambda: _hf_generate(plain, next(theirs).repeat_interleave(n, dim=0), new_tokens),
        lambda: _ours(engine, next(mine).tolist(), n, new_tokens),
    )
    return {
        "prompts": prompts_n,
        "n": n,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        **_speed(times, prompts_n * n * new_tokens, target=1.5),
    }


# (g) A multi-turn rollout: each turn's prompt is the last turn's prompt, its completion and a
# new observation (a tool's output, the environment's reply), as agentic RL sends them.
MULTI_TURN = {
    "rollouts": 16,
    "turns": 4,
    "prompt_len": 256,
    "observation_len": 64,
    "new_tokens": 32,
}


def _multi_turn_run(side, seed: int) -> float:
    """One multi-turn run of ``side`` (an engine, or the plain model for ``model.generate``):
    new random prompts and observations from ``seed``; the seconds spent in its generate calls.
    Every completion has exactly ``new_tokens`` tokens, so each turn's prompts are equally long
    on every side, whatever tokens it sampled."""
    shape = MULTI_TURN
    rollouts, new_tokens = shape["rollouts"], shape["new_tokens"]
    gen = _gen(seed)
    prompts = torch.randint(5, 100, (rollouts, shape["prompt_len"]), generator=gen).tolist()
    elapsed = 0.0
    for _ in range(shape["turns"]):
        start = time.perf_counter()
        if isinstance(side, torch.nn.Module):
            out = _hf_generate(side, torch.tensor(prompts), new_tokens)
            completions = out[:, -new_tokens:].tolist()
        else:
            params = [
                {"max_tokens": new_tokens, "min_tokens": new_tokens, "seed": i}
                for i in range(rollouts)
            ]
            completions = [o["token_ids"] for o in side.generate(prompts, params)]
        elapsed += time.perf_counter() - start
        observations = torch.randint(5, 100, (rollouts, shape["observation_len"]), generator=gen)
        prompts = [
            p + c + o for p, c, o in zip(prompts, completions, observations.tolist(), strict=True)
        ]
    return elapsed


def bench_multi_turn(sides: dict) -> dict:
    """(g): every side in turn, ``REPEAT`` runs each after a warm-up run, new prompts every run;
    tokens per second from each side's best run (generated tokens over time in generate)."""
    for side in sides.values():
        _multi_turn_run(side, seed=20)
    times: dict[str, list[float]] = {key: [] for key in sides}
    for run in range(REPEAT):
        for key, side in sides.items():
            times[key].append(_multi_turn_run(side, seed=21 + run))
    best = {key: min(values) for key, values in times.items()}
    tokens = MULTI_TURN["rollouts"] * MULTI_TURN["turns"] * MULTI_TURN["new_tokens"]
    return {
        **MULTI_TURN,
        **{f"{key}_tokens_per_s": tokens / best[key] for key in sides},
        **{f"{key}_s": best[key] for key in sides},
        "median_s": {key: statistics.median(values) for key, values in times.items()},
    }


def _client_latencies(engine: SamplingEngine, arrivals: list[float], prompts: list) -> list[float]:
    """Each client waits for its arrival time, sends its request, records its latency."""
    latencies = [0.0] * len(arrivals)
    start = time.perf_counter()

    def client(i: int) -> None:
        time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        sent = time.perf_counter()
        _ours(engine, [prompts[i]], 1, CLIENT_NEW_TOKENS)
        latencies[i] = time.perf_counter() - sent

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(arrivals))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


CLIENTS, CLIENT_WINDOW_S, CLIENT_NEW_TOKENS = 16, 3.0, 128


def bench_concurrent_clients(engine: SamplingEngine) -> dict:
    one_at_a_time = SamplingEngine(SamplingEngineConfig(model=MODEL, continuous_batching=False))
    sync_in_process(engine.model, one_at_a_time)
    draw = random.Random(3)
    arrivals = sorted(draw.uniform(0, CLIENT_WINDOW_S) for _ in range(CLIENTS))
    runs: dict[str, list[dict]] = {"one_at_a_time": [], "running_batch": []}
    for batch in _new_prompts((CLIENTS, 64), seed=4, turns=2):
        prompts = batch.tolist()  # both sides, each engine seeing them once: no prompt cache hit
        for name, which in (("one_at_a_time", one_at_a_time), ("running_batch", engine)):
            latencies = sorted(_client_latencies(which, arrivals, prompts))
            runs[name].append(
                {
                    "mean_s": statistics.fmean(latencies),
                    "p90_s": latencies[int(0.9 * (len(latencies) - 1))],
                }
            )
    best = {name: min(r, key=lambda r: r["mean_s"]) for name, r in runs.items()}
    return {
        "clients": CLIENTS,
        "window_s": CLIENT_WINDOW_S,
        "prompt_len": 64,
        "new_tokens": CLIENT_NEW_TOKENS,
        **{name: {**best[name], "runs": runs[name]} for name in runs},
        "mean_latency_ratio": best["one_at_a_time"]["mean_s"] / best["running_batch"]["mean_s"],
        "p90_latency_ratio": best["one_at_a_time"]["p90_s"] / best["running_batch"]["p90_s"],
        "joins": engine.batch_state()["joins"],
        "target": "mean latency drops (ratio > 1)",
    }


def _multi_turn_ratios(engine: SamplingEngine, plain) -> dict:
    """(g) for our engine with its prompt cache, without it, and ``model.generate``."""
    uncached = SamplingEngine(SamplingEngineConfig(model=MODEL, prompt_cache_bytes=0))
    result = bench_multi_turn({"generate": plain, "cache_off": uncached, "engine": engine})
    result["engine_vs_cache_off"] = result["cache_off_s"] / result["engine_s"]
    result["engine_vs_generate"] = result["generate_s"] / result["engine_s"]
    return result


def bench_weight_sync(engine: SamplingEngine) -> dict:
    trainer = load_causal_lm(MODEL)
    with torch.no_grad():
        for param in trainer.parameters():
            param.mul_(1.01)  # different weights, so every sync really changes the sampler
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    in_process = min(_timed(lambda: sync_in_process(trainer, engine)) for _ in range(REPEAT))

    def through_chunks() -> None:
        engine.load_weights(iter_weights_from_chunks(stream_weights(trainer, CHUNK_BYTES)))

    serialised = min(_timed(through_chunks) for _ in range(REPEAT))
    chunks = list(stream_weights(trainer, CHUNK_BYTES))
    cross = min(_send_to_receiver(chunks) for _ in range(REPEAT))
    return {
        "weight_bytes": nbytes,
        "chunk_bytes": CHUNK_BYTES,
        "chunks": len(chunks),
        "in_process_s": in_process,
        "in_process_mb_per_s": nbytes / in_process / MB,
        "chunk_stream_in_process_s": serialised,
        "chunk_stream_in_process_mb_per_s": nbytes / serialised / MB,
        "cross_process_s": cross,
        "cross_process_mb_per_s": nbytes / cross / MB,
    }


def _send_to_receiver(chunks: list[bytes]) -> float:
    """Seconds from the first chunk byte written to a ready receiver until it reports loaded."""
    root = Path(__file__).resolve().parent.parent
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.engine_sample", "--receive"],
        cwd=root,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout.readline().strip() == b"ready"
        start = time.perf_counter()
        for blob in chunks:
            child.stdin.write(struct.pack("<Q", len(blob)))
            child.stdin.write(blob)
        child.stdin.write(struct.pack("<Q", 0))
        child.stdin.flush()
        report = json.loads(child.stdout.readline())
        elapsed = time.perf_counter() - start
        assert report["complete"], report
        return elapsed
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def receive() -> None:
    """Receiver process: length-prefixed chunks on stdin into a SamplingEngine; report on stdout."""
    engine = SamplingEngine(SamplingEngineConfig(model=MODEL))
    source = sys.stdin.buffer

    def chunks():
        while True:
            (size,) = struct.unpack("<Q", source.read(8))
            if size == 0:
                return
            yield source.read(size)

    print("ready", flush=True)
    report = engine.load_weights(iter_weights_from_chunks(chunks()))
    print(json.dumps(report), flush=True)


# name: (the prompt batches, a list of one (sent every turn) or one per turn; n; new tokens;
# whether a prompt's n samples go as n requests of n = 1 each, as SkyRL sends them)
VLLM_WORKLOADS = {
    "throughput": (lambda: [torch.randint(5, 100, (32, 64), generator=_gen(1))], 1, 128, False),
    "prefix_sharing": (lambda: [torch.randint(5, 100, (2, 512), generator=_gen(2))], 8, 64, False),
    "prefix_sharing_new_prompts": (
        lambda: _new_prompts((2, 512), seed=5, turns=VLLM_REPEAT + 1),
        8,
        64,
        False,
    ),
    "prefix_sharing_as_requests_new_prompts": (
        lambda: _new_prompts((2, 512), seed=6, turns=VLLM_REPEAT + 1),
        8,
        64,
        True,
    ),
}


# (f) Issue 25's real-size sampling shape, on the Qwen3-architecture model with the real
# vocabulary (benchmarks/local_qwen3.py): 4 prompts of 256 tokens, n = 4, 64 new tokens.
REAL_VOCAB_WORKLOADS = {
    "real_vocab_new_prompts": (
        lambda: _new_prompts((4, 256), seed=7, turns=VLLM_REPEAT + 1),
        4,
        64,
        False,
    ),
}


def _vllm_workload(
    sides: dict, batches: list[torch.Tensor], n: int, new_tokens: int, as_requests: bool
) -> dict:
    """One workload of (d): a warm-up turn, then ``VLLM_REPEAT`` turns of every side in turn;
    turn ``i`` sends ``batches[i]`` (the same batch every turn when there is one)."""

    def run(key: str, turn: int) -> None:
        prompts = batches[turn % len(batches)]
        if key == "generate":
            _hf_generate(sides[key], prompts.repeat_interleave(n, dim=0), new_tokens)
        elif as_requests:
            requests = prompts.repeat_interleave(n, dim=0).tolist()
            _ours(sides[key], requests, 1, new_tokens, seed_each=True)
        else:
            _ours(sides[key], prompts.tolist(), n, new_tokens)

    for key in sides:
        run(key, 0)  # warm up every path on the real shapes
    times = {key: [] for key in sides}
    for turn in range(1, VLLM_REPEAT + 1):
        for key in sides:
            times[key].append(_timed(lambda key=key, turn=turn: run(key, turn)))
    best = {key: min(values) for key, values in times.items()}
    prompts = batches[0]
    return {
        "prompts": len(prompts),
        "n": n,
        "prompt_len": prompts.shape[1],
        "new_tokens": new_tokens,
        "new_prompts_each_turn": len(batches) > 1,
        "sent_as": f"{len(prompts) * n} requests of n=1" if as_requests else f"n={n}",
        **{f"{key}_tokens_per_s": len(prompts) * n * new_tokens / best[key] for key in sides},
        "vllm_vs_generate": best["generate"] / best["vllm"],
        "vllm_vs_engine": best["engine"] / best["vllm"],
        "median_s": {key: statistics.median(values) for key, values in times.items()},
    }


def bench_vllm(model: ModelConfig = MODEL, workloads: dict = VLLM_WORKLOADS) -> dict:
    """(d) and (f): the vLLM engine against ours and ``model.generate`` (see the module
    docstring)."""
    from arctic_platform.engine.vllm_backend.engine import VllmSamplingEngine

    vllm_config = SamplingEngineConfig(
        model=model, engine="vllm", vllm={"env": {"VLLM_CPU_KVCACHE_SPACE": "2"}}
    )
    startup = {}
    start = time.perf_counter()
    ours = SamplingEngine(SamplingEngineConfig(model=model))
    ours.generate([[5, 6, 7]], {"max_tokens": 1})
    startup["engine_s"] = time.perf_counter() - start
    start = time.perf_counter()
    vllm = VllmSamplingEngine(vllm_config)
    vllm.generate([[5, 6, 7]], {"max_tokens": 1})
    startup["vllm_s"] = time.perf_counter() - start
    plain = _plain_model(model)
    try:
        result: dict = {"startup_to_first_token": startup}
        for name, (batches, n, new_tokens, as_requests) in workloads.items():
            result[name] = _vllm_workload(
                {"generate": plain, "engine": ours, "vllm": vllm},
                batches(),
                n,
                new_tokens,
                as_requests,
            )
        trainer = load_causal_lm(model)
        with torch.no_grad():
            for param in trainer.parameters():
                param.mul_(1.01)
        sync = {}
        for method in ("reload", "restart"):
            vllm.weight_sync = method
            sync[f"{method}_s"] = min(
                _timed(lambda: sync_in_process(trainer, vllm)) for _ in range(REPEAT)
            )
        sync["in_process_ours_s"] = min(
            _timed(lambda: sync_in_process(trainer, ours)) for _ in range(REPEAT)
        )
        result["weight_sync"] = sync
        if model == MODEL:
            turns = bench_multi_turn({"generate": plain, "engine": ours, "vllm": vllm})
            turns["vllm_vs_engine"] = turns["engine_s"] / turns["vllm_s"]
            result["multi_turn"] = turns
        result["vllm"] = vllm.info
        return result
    finally:
        vllm.close()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def main() -> None:
    torch.manual_seed(0)
    engine = SamplingEngine(SamplingEngineConfig(model=MODEL))
    plain = _plain_model()
    result = {
        "model": MODEL.name,
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "torch_threads": torch.get_num_threads(),
        "throughput": bench_throughput(engine, plain),
        "prefix_sharing": bench_prefix_sharing(engine, plain),
        "concurrent_clients": bench_concurrent_clients(engine),
        "multi_turn": _multi_turn_ratios(engine, plain),
        "weight_sync": bench_weight_sync(engine),
        "load_average": list(os.getloadavg()),
    }
    write_result("engine_sample", result)


if __name__ == "__main__":
    if "--receive" in sys.argv:
        receive()
    elif "--vllm" in sys.argv and "--real-vocab" in sys.argv:
        from benchmarks.local_qwen3 import Qwen3Shape, qwen3_model_path

        torch.manual_seed(0)
        shape = Qwen3Shape()
        real = ModelConfig(name=qwen3_model_path(shape))
        write_result(
            "engine_sample_vllm_real_vocab",
            {
                "model": f"Qwen3 architecture, built locally: {shape}",
                "torch_threads": torch.get_num_threads(),
                **bench_vllm(real, REAL_VOCAB_WORKLOADS),
            },
        )
    elif "--vllm" in sys.argv:
        torch.manual_seed(0)
        write_result(
            "engine_sample_vllm",
            {"model": MODEL.name, "torch_threads": torch.get_num_threads(), **bench_vllm()},
        )
    else:
        main()
