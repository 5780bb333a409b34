"""A GRPO step through the Tinker SDK vs the same step through our own client, same server.

One ``arctic-platform serve`` process (started here) runs both. A step is what an RL loop does per
iteration: move the trainer's weights to the sampler, sample ``G`` prompts ``n`` times with
log-probs, one ``forward_backward`` with the ``importance_sampling`` loss on the ``G x n``
sequences (sampler log-probs as the old policy, group-centred advantages), one optimizer step.

* Tinker: ``save_weights_and_get_sampling_client`` -> ``sample`` per prompt (concurrent futures)
  -> ``forward_backward(datums, "importance_sampling")`` + ``optim_step(AdamParams)``. With
  ``--one-request-per-sample`` it samples as tinker-cookbook's RL loop does: every sample its own
  request (``num_samples=1``), ``G x n`` requests at once.
* Ours (``http`` backend): ``sync_weights`` -> one ``generate`` (``n`` per prompt) ->
  ``fwd_bwd`` with the same loss -> ``step``.

Both train a LoRA adapter of the same rank and scale on the same base model. The two loops' steps
alternate in one run (the machine may be shared; alternation spreads outside load over both).
Reported: the median step time of each after a warm-up step, their ratio (target: Tinker <= 1.2x
ours) and the ratio of each alternated pair.

Run: ``OMP_NUM_THREADS=1 python -m benchmarks.tinker [--model builtin:tiny --steps 10]``;
writes ``benchmarks/results/tinker.json`` (``tinker_one_request_per_sample.json`` with that
flag). Needs the ``tinker`` extra (Python >= 3.11).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tinker
from tinker import types

from arctic_platform.client import create_arctic_rl_client
from arctic_platform.client.local_server import LocalServer
from arctic_platform.engine.builtin import build_tokenizer
from arctic_platform.server.tinker.losses import processing_for
from benchmarks._common import write_result

RANK = 8
LEARNING_RATE = 1e-4
MAX_TOKENS = 16
# The engine loss Tinker's importance_sampling maps onto (the same math for both clients).
PROCESSING = processing_for("importance_sampling", {})


def prompts(groups: int) -> list[list[int]]:
    tokenizer = build_tokenizer()
    texts = [f"{i + 11}+{3 * i + 7}=" for i in range(groups)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def reward(tokens: list[int]) -> float:
    """A cheap stand-in reward (the step's cost, not learning, is measured)."""
    return float(len(tokens) % 2)


class TinkerLoop:
    """The step through the Tinker SDK."""

    def __init__(
        self, url: str, model: str, groups: int, samples: int, one_request_per_sample: bool
    ) -> None:
        self.one_request_per_sample = one_request_per_sample
        self.service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        self.trainer = self.service.create_lora_training_client(
            base_model=model, rank=RANK, seed=0
        ).result()
        self.params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)
        self.prompts, self.samples = prompts(groups), samples

    def step(self) -> None:
        trainer = self.trainer
        sampler = trainer.save_weights_and_get_sampling_client().result()
        requests, each = (self.samples, 1) if self.one_request_per_sample else (1, self.samples)
        futures = [
            (
                p,
                [
                    sampler.sample(types.ModelInput.from_ints(p), each, self.params)
                    for _ in range(requests)
                ],
            )
            for p in self.prompts
        ]
        data = []
        for prompt, group in futures:
            sequences = [s for future in group for s in future.result().sequences]
            adv = advantages([reward(s.tokens) for s in sequences])
            for seq, a in zip(sequences, adv, strict=True):
                pad = len(prompt) - 1
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": prompt[1:] + seq.tokens,
                            "logprobs": [0.0] * pad + list(seq.logprobs),
                            "advantages": [0.0] * pad + [a] * len(seq.tokens),
                        },
                    )
                )
        fwd_bwd = trainer.forward_backward(data, "importance_sampling")
        optim = trainer.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
        fwd_bwd.result()
        optim.result()

    def close(self) -> None:
        self.service.close("success").result()


class ClientLoop:
    """The same step through our own client (``http`` backend)."""

    def __init__(self, url: str, model: str, groups: int, samples: int) -> None:
        config = {
            "model": model,
            "seed": 0,
            "backend": {"type": "http", "url": url},
            "training": {
                "optimizer": {"lr": LEARNING_RATE},
                "lora": {"r": RANK, "alpha": float(RANK)},
            },
            "sampling": {},
        }
        self.client = create_arctic_rl_client(config, blocking_calls=True)
        self.prompts, self.samples = prompts(groups), samples
        self.sampling = {"n": samples, "max_tokens": MAX_TOKENS, "temperature": 1.0, "logprobs": 0}

    def step(self) -> None:
        client, samples = self.client, self.samples
        client.sync_weights()
        outputs = client.generate(prompt_ids=self.prompts, sampling_params=self.sampling)
        rows = []
        for g, prompt in enumerate(self.prompts):
            group = outputs[g * samples : (g + 1) * samples]
            adv = advantages([reward(o["token_ids"]) for o in group])
            rows += [(prompt, o, a) for o, a in zip(group, adv, strict=True)]
        width = max(len(p) + len(o["token_ids"]) for p, o, _ in rows)
        batch = {
            name: np.zeros((len(rows), width), dtype)
            for name, dtype in (
                ("input_ids", np.int64),
                ("attention_mask", np.int64),
                ("loss_mask", np.int64),
                ("old_log_probs", np.float32),
                ("advantages", np.float32),
            )
        }
        for i, (prompt, out, adv) in enumerate(rows):
            ids, start = prompt + out["token_ids"], len(prompt)
            batch["input_ids"][i, : len(ids)] = ids
            batch["attention_mask"][i, : len(ids)] = 1
            batch["loss_mask"][i, start : len(ids)] = 1
            old = [t["logprob"] for t in out["logprobs"]]
            batch["old_log_probs"][i, start : len(ids)] = old
            batch["advantages"][i, start : len(ids)] = adv
        client.fwd_bwd({"batch": batch, "processing": PROCESSING})
        client.step(LEARNING_RATE)

    def close(self) -> None:
        self.client.close()


def timed(step) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def alternated_steps(
    url: str, model: str, groups: int, samples: int, steps: int, one_request_per_sample: bool
) -> dict:
    """Both loops on one server, their steps alternated (and which goes first alternated too),
    so load from other processes on the machine falls on both alike. One warm-up step each."""
    loops = {
        "arctic_client": ClientLoop(url, model, groups, samples),
        "tinker_sdk": TinkerLoop(url, model, groups, samples, one_request_per_sample),
    }
    try:
        for loop in loops.values():
            loop.step()
        times: dict[str, list[float]] = {name: [] for name in loops}
        for i in range(steps):
            order = list(loops) if i % 2 == 0 else list(reversed(loops))
            for name in order:
                times[name].append(timed(loops[name].step))
    finally:
        for loop in loops.values():
            loop.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--one-request-per-sample",
        action="store_true",
        help="the Tinker loop sends each sample as its own request, as tinker-cookbook does",
    )
    args = parser.parse_args()
    shape = (args.model, args.groups, args.samples, args.steps, args.one_request_per_sample)
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalServer(data_dir=Path(tmp) / "server", device="cpu") as url,
    ):
        times = alternated_steps(url, *shape)
    sdk, ours = times["tinker_sdk"], times["arctic_client"]
    median = {"tinker_sdk": statistics.median(sdk), "arctic_client": statistics.median(ours)}
    ratio = round(median["tinker_sdk"] / median["arctic_client"], 3)
    pairs = [round(t / o, 3) for t, o in zip(sdk, ours, strict=True)]
    write_result(
        "tinker_one_request_per_sample" if args.one_request_per_sample else "tinker",
        {
            "model": args.model,
            # torch threads of both processes (1 keeps a shared machine's load from stalling
            # OpenMP barriers; both loops run on the same server, so the ratio is unaffected)
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "step": {
                "groups": args.groups,
                "samples_per_group": args.samples,
                "max_tokens": MAX_TOKENS,
                "lora_rank": RANK,
                "tinker_requests": "one per sample"
                if args.one_request_per_sample
                else "one per prompt (num_samples=n)",
                "loss": "importance_sampling",
            },
            "step_seconds": {"tinker_sdk": sdk, "arctic_client": ours},
            "median_step_seconds": median,
            "ratio_tinker_vs_client": ratio,
            "ratio_per_step_pair": pairs,
            "target": 1.2,
            "target_met": ratio <= 1.2,
        },
    )


if __name__ == "__main__":
    main()
