"""FakeEngine: engines that implement the server's engine Protocols without torch, for tests whose
subject is not the engine (auth, limits, paths, the jobs API, observability, the API surfaces).

A fake job is an ordinary job (the same create-job body, model name and sub-jobs): only its
engines differ. A test gets one by handing a Service the builder here,
``Service(settings, engine_builder=build_fake_engine)`` (the ``fake_service`` fixture of
``tests/server/conftest.py``); nothing a client sends can reach it. The fakes are deterministic
and cheap, and every number depends on the inputs and on the state the ops changed, so a test
can tell ops, jobs and weights apart:

* a trainer's "weights" are one number, ``weight``; ``forward_backward`` adds the batch's loss to
  a pending gradient, ``step`` moves ``weight`` by ``-lr * gradient`` and counts steps, a
  checkpoint saves and restores them (a real checkpoint folder, written through the engine's
  crash-safe staging and found by its lookups), a weight sync copies ``weight`` to a sampler;
* a token's log-prob is a function of the token, its position and ``weight``; the loss is the
  mean negative log-prob of the scored tokens;
* a sample's tokens are a function of the prompt, the sample's index, its seed and the
  sampler's ``weight``; ``n``, ``max_tokens`` and ``logprobs`` are honoured, stop conditions are
  not (every sample ends at ``max_tokens``, ``finish_reason`` "length").

Input checks are the contract's rules (``contract/bodies.py``, ``contract/sampling_params.py``)
plus the vocabulary and context checks every engine adds, raising the engine's
``EngineInputError`` naming the field, so a bad request fails here as it fails on a real engine.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from arctic_platform.contract.bodies import context_problem, learning_rate_problem, prompts_problem
from arctic_platform.contract.results import loss_fields
from arctic_platform.contract.sampling_params import SamplingParams
from arctic_platform.engine import cancellation
from arctic_platform.engine.checkpoint_layout import (
    LATEST_FILE,
    TRAINER_STATE,
    checkpoint_id,
    resolve_checkpoint,
)
from arctic_platform.engine.checkpoint_staging import staged, write_text_atomic, writing
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.wake_tags import checked_wake_tags
from arctic_platform.server.engines import inference_config_for, training_config_for, weights_dir

VOCAB_SIZE = 128
MAX_MODEL_LEN = 256
# What a fake checkpoint folder holds besides the trainer state: a config.json, so that a
# sampling sub-job can start from it as from a real full-model checkpoint (engines.weights_dir).
MODEL_CONFIG = "config.json"


def gated_builder(build, gate: threading.Event, timeout_s: float = 120):
    """The engine builder ``build`` behind ``gate``: a job stays starting until the test sets it
    (or ``timeout_s`` passes)."""

    def builder(service, sub, source: dict | None):
        gate.wait(timeout=timeout_s)
        return build(service, sub, source)

    return builder


def build_fake_engine(service, sub, source: dict | None):
    """The Service's engine builder for fakes (``engines.EngineBuilder``): the fake of
    ``sub.kind``, configured from the sub-job's spec as the real engine would be."""
    if sub.kind == "training":
        config = training_config_for(service, sub, source, device="cpu")
        engine = FakeTrainer(
            checkpoint_dir=config.checkpoint_dir,
            job_name=config.job_name,
            lr=config.optimizer.lr,
            seed=config.seed,
        )
        if source is not None:
            engine.load_checkpoint(source["path"])
        return engine
    config = inference_config_for(service, sub, source, device="cpu")
    weight = 0.0 if source is None else _read_state(Path(weights_dir(source)))["weight"]
    if sub.kind == "sampling":
        return FakeSampler(seed=config.seed, weight=weight)
    return FakeScorer(weight=weight)


def _read_state(folder: Path) -> dict:
    return json.loads((folder / TRAINER_STATE).read_text())


class _FakeModel:
    """What the three fakes share: the vocabulary, the context, a text tokenizer, log-probs."""

    vocab_size = VOCAB_SIZE
    max_model_len = MAX_MODEL_LEN

    def __init__(self, weight: float) -> None:
        self.weight = weight

    def close(self) -> None:
        """Nothing held outside this process."""

    def token_logprob(self, token: int, position: int) -> float:
        """A log-prob in (-4.6, -0.05): depends on the token, its position and the weight."""
        return -0.05 - ((token * 7 + position * 3) % 97) / 22.0 - abs(self.weight) / 100.0

    def encode(self, text: str) -> list[int]:
        return [ord(ch) % VOCAB_SIZE for ch in text]

    @staticmethod
    def decode(token_ids: Sequence[int]) -> str:
        return "".join(chr(32 + t % 95) for t in token_ids)

    def checked_ids(self, field: str, value: Any) -> list[int]:
        ids = self.encode(value) if isinstance(value, str) else [int(t) for t in value]
        if any(not 0 <= t < VOCAB_SIZE for t in ids):
            raise EngineInputError(field, f"token ids must lie in [0, {VOCAB_SIZE})")
        return ids

    def checked_batch(self, batch: Mapping | None) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, attention_mask)`` of a training batch, checked as the engines check
        them (``engine/batching.validate_batch``): present, ``[B, S]``, ids in the vocabulary,
        no empty row, no row past the context."""
        if not isinstance(batch, Mapping):
            raise EngineInputError("batch", "expected a dict of tensors")
        if "input_ids" not in batch:
            raise EngineInputError("batch.input_ids", "is required")
        if "attention_mask" not in batch:
            raise EngineInputError("batch.attention_mask", "is required")
        ids, mask = np.asarray(batch["input_ids"]), np.asarray(batch["attention_mask"])
        if ids.ndim != 2 or 0 in ids.shape:
            raise EngineInputError("batch.input_ids", f"expected [B, S], got {list(ids.shape)}")
        if mask.shape != ids.shape:
            raise EngineInputError(
                "batch.attention_mask", f"expected {list(ids.shape)}, got {list(mask.shape)}"
            )
        if (ids < 0).any() or (ids >= VOCAB_SIZE).any():
            raise EngineInputError(
                "batch.input_ids",
                f"token ids must lie in [0, {VOCAB_SIZE}) (the model's vocabulary)",
            )
        lengths = mask.sum(1)
        if (lengths == 0).any():
            raise EngineInputError(
                "batch.attention_mask", f"row {int(np.argmin(lengths))} has no tokens"
            )
        problem = context_problem("batch.input_ids", "row", int(lengths.max()), MAX_MODEL_LEN)
        if problem is not None:
            raise EngineInputError(problem.field, problem.message)
        return ids.astype(np.int64), mask.astype(bool)

    def batch_logprobs(self, ids: np.ndarray) -> np.ndarray:
        """Position-indexed ``[B, S]`` float32 log-probs (column ``t`` scores ``ids[:, t]``)."""
        out = np.zeros(ids.shape, np.float32)
        for (row, col), token in np.ndenumerate(ids):
            out[row, col] = self.token_logprob(int(token), col)
        return out

    def forward_outputs(self, batch: Mapping | None, meta: Mapping | None) -> dict:
        ids, mask = self.checked_batch(batch)
        logprobs = np.where(mask, self.batch_logprobs(ids), 0.0).astype(np.float32)
        out: dict[str, Any] = {"logprobs": logprobs}
        if (meta or {}).get("calculate_entropy"):
            out["entropy"] = np.where(mask, np.float32(math.log(VOCAB_SIZE)), 0.0).astype(
                np.float32
            )
        return out


@dataclass(frozen=True)
class FakeWeights:
    """A fake trainer's weight at one moment (its ``weight_snapshot``)."""

    weight: float

    def load_into(self, sampler: FakeSampler) -> dict:
        sampler.weight = self.weight
        return {"loaded": 1}


class FakeTrainer(_FakeModel):
    """A training sub-job's fake (``TrainingEngineProtocol``)."""

    def __init__(self, *, checkpoint_dir: str | None, job_name: str, lr: float, seed: int) -> None:
        super().__init__(weight=float(seed % 10))
        self.checkpoint_dir = checkpoint_dir
        self.job_name = job_name
        self.lr = lr
        self.gradient = 0.0
        self.global_steps = 0
        self.setting_fallbacks: dict[str, str] = {}

    def forward_backward(self, batch, meta=None, processing=None, *, with_logprobs=False) -> dict:
        cancellation.check()
        out = self.forward_outputs(batch, meta)
        mask = np.asarray(batch["attention_mask"]).astype(bool)
        scored = mask[:, 1:]  # the first token of a row has no prediction to score
        loss = float(-out["logprobs"][:, 1:][scored].mean()) if scored.any() else 0.0
        tokens = int(scored.sum())
        self.gradient += loss
        metrics = {"loss": loss}
        answer = {
            **loss_fields(metrics),
            "metrics": metrics,
            "metric_sums": {"loss.sum": loss * tokens, "loss.tokens": float(tokens)},
        }
        if with_logprobs:
            answer["logprobs"] = out["logprobs"]
        return answer

    def forward(self, batch, meta=None, processing=None) -> dict:
        cancellation.check()
        return self.forward_outputs(batch, meta)

    def step(self, learning_rate: float | None = None, *, adam: Any = None) -> dict:
        problem = learning_rate_problem(learning_rate)
        if problem is not None:
            raise EngineInputError(problem.field, problem.message)
        if learning_rate is not None:
            self.lr = float(learning_rate)
        grad_norm = abs(self.gradient)
        self.weight -= self.lr * self.gradient
        self.gradient = 0.0
        self.global_steps += 1
        values = {"grad_norm": grad_norm, "last_lr": self.lr}
        return {**values, "global_steps": self.global_steps, "metrics": {**values, "skipped": 0}}

    def save_checkpoint(self, path=None, *, step=None, export_hf=False, save_total_limit=None):
        job_dir = self._job_dir(path)
        step = self.global_steps if step is None else int(step)
        final = job_dir / checkpoint_id(step)
        state = {"global_steps": self.global_steps, "weight": self.weight, "lr": self.lr}
        with staged(final) as staging:
            (staging / TRAINER_STATE).write_text(json.dumps(state))
            (staging / MODEL_CONFIG).write_text(json.dumps({"model_type": "fake"}))
        with writing():
            write_text_atomic(job_dir / LATEST_FILE, str(step))
        return {
            "path": str(final),
            "global_step": step,
            "checkpoint_id": final.name,
            "hf_path": str(final),
        }

    def load_checkpoint(self, path=None, *, step=None, optimizer=True) -> dict:
        directory = resolve_checkpoint(self._job_dir(path), None if step is None else int(step))
        state = _read_state(directory)
        self.global_steps, self.weight, self.lr = (
            state["global_steps"],
            state["weight"],
            state["lr"],
        )
        self.gradient = 0.0
        return {
            "path": str(directory),
            "global_step": self.global_steps,
            "checkpoint_id": directory.name,
        }

    def sync_weights_to(self, target: FakeSampler) -> dict:
        return self.weight_snapshot().load_into(target)

    def weight_snapshot(self) -> FakeWeights:
        return FakeWeights(self.weight)

    def sleep(self, mode: str = "all") -> dict:
        return {"offloaded": False, "reason": "model is on cpu"}

    def wake(self) -> dict:
        return {"offloaded": False, "reason": "model is on cpu"}

    def empty_cache(self) -> dict:
        return {"emptied": False, "reason": "no allocator cache on cpu"}

    def _job_dir(self, path) -> Path:
        if path is not None:
            return Path(path)
        if self.checkpoint_dir is None:
            raise EngineInputError("path", "no checkpoint folder: pass path or set checkpoint_dir")
        return Path(self.checkpoint_dir) / self.job_name


class FakeSampler(_FakeModel):
    """A sampling sub-job's fake (``SamplingEngineProtocol``)."""

    concurrent_generate = False  # no running batch: generates run one at a time
    tokenizer = None  # no Hugging Face tokenizer (as the Ray replica): ``tokenize`` is a 400

    def __init__(self, *, seed: int, weight: float = 0.0) -> None:
        super().__init__(weight=weight)
        self.seed = seed
        self.asleep: set[str] = set()

    def generate(self, prompts, sampling_params=None) -> list[dict]:
        cancellation.check()
        problem = prompts_problem(prompts)
        if problem is not None:
            raise EngineInputError(problem.field, problem.message)
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            if len(sampling_params) != len(prompts):
                raise EngineInputError("sampling_params", "one dictionary per prompt, or one")
            fields = [f"sampling_params[{i}]" for i in range(len(prompts))]
            params = [
                SamplingParams.from_request(p, f)
                for p, f in zip(sampling_params, fields, strict=True)
            ]
        else:
            params = [SamplingParams.from_request(sampling_params)] * len(prompts)
        token_ids = [self.checked_ids(f"prompts[{i}]", p) for i, p in enumerate(prompts)]
        outputs = []
        for index, (ids, p) in enumerate(zip(token_ids, params, strict=True)):
            length = p.max_tokens if p.max_tokens is not None else MAX_MODEL_LEN - len(ids)
            problem = context_problem(
                f"prompts[{index}]", "prompt + max_tokens", len(ids) + length, MAX_MODEL_LEN
            )
            if problem is not None:
                raise EngineInputError(problem.field, problem.message)
            for sample in range(p.n):
                outputs.append(self._sample(ids, index, sample, length, p))
        return outputs

    def _sample(self, prompt: list[int], index: int, sample: int, length: int, p) -> dict:
        base = (
            sum(prompt) * 31 + sample * 17 + (p.seed or self.seed) * 13 + round(self.weight * 1000)
        )
        ids = [(base + 7 * t) % VOCAB_SIZE for t in range(length)]
        out = {
            "text": self.decode(ids),
            "token_ids": ids,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_len": len(prompt),
            "prompt_index": index,
            "sample_index": sample,
            "cached_prompt_tokens": 0,  # it keeps no prompt cache
        }
        if p.logprobs is not None:
            positions = range(len(prompt), len(prompt) + length)
            out["logprobs"] = [
                {
                    "token_id": token,
                    "logprob": self.token_logprob(token, pos),
                    "rank": 1,
                    "top": [[token, self.token_logprob(token, pos)]][: p.logprobs],
                }
                for token, pos in zip(ids, positions, strict=True)
            ]
        return out

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float | None]:
        return [None, *(self.token_logprob(t, i) for i, t in enumerate(token_ids) if i)]

    def sleep(self, level: int = 1) -> dict:
        """The CPU sampler's answer: its KV cache released, its weights kept."""
        if isinstance(level, bool) or level not in (1, 2):
            raise EngineInputError("level", f"must be 1 or 2, got {level!r}")
        self.asleep.add("kv_cache")
        result: dict[str, Any] = {
            "level": level,
            "kv_cache_bytes_released": 0,
            "prompt_cache_bytes_released": 0,
        }
        if level == 2:
            result["packed_weight_bytes_released"] = 0
            result["weights"] = "kept: the engine runs on CPU, there is no device to free"
        return {**result, "asleep": sorted(self.asleep)}

    def wake(self, tags=None) -> dict:
        woke = sorted(self.asleep & set(checked_wake_tags(tags)))
        self.asleep -= set(woke)
        return {"woke": woke, "kv_cache_bytes": 0, "asleep": sorted(self.asleep)}

    def reset_prefix_cache(self) -> dict:
        return {"cached_prefixes": 0, "bytes_released": 0}


class FakeScorer(_FakeModel):
    """A log-prob sub-job's fake (``LogProbEngineProtocol``)."""

    tokenizer = None  # no Hugging Face tokenizer, as the Ray replica

    def forward(self, batch, meta=None, processing=None) -> dict:
        cancellation.check()
        return self.forward_outputs(batch, meta)

    def log_probs(self, prompts, completions=None, top_k: int = 1) -> list[dict]:
        for name, values in (("prompts", prompts), ("completions", completions)):
            problem = None if values is None else prompts_problem(values, name=name)
            if problem is not None:
                raise EngineInputError(problem.field, problem.message)
        if completions is not None and len(completions) != len(prompts):
            raise EngineInputError(
                "completions", f"expected a list with one entry per prompt ({len(prompts)})"
            )
        results = []
        for i, prompt in enumerate(prompts):
            prompt_ids = self.checked_ids(f"prompts[{i}]", prompt)
            completion_ids = (
                [] if completions is None else self.checked_ids(f"completions[{i}]", completions[i])
            )
            row = prompt_ids + completion_ids
            start = len(prompt_ids) if completions is not None else 0
            logprobs: list[float | None] = [
                self.token_logprob(row[t], t) for t in range(start, len(row))
            ]
            tops: list[list | None] = [
                [[row[t], lp]][:top_k]
                for t, lp in zip(range(start, len(row)), logprobs, strict=True)
            ]
            if completions is None:
                logprobs[0] = tops[0] = None
            results.append(
                {
                    "prompt_token_ids": prompt_ids,
                    "completion_token_ids": completion_ids,
                    "logprobs": logprobs,
                    "top_logprobs": tops,
                }
            )
        return results
