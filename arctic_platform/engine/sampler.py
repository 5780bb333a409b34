"""SamplingEngine: batched generation with a KV cache, the torch backend of the ``generate`` op.

How a call runs:

1. Everything is validated first (prompts, every sampling parameter, context lengths, the cache
   budget); a bad request raises a :class:`~arctic_platform.contract.problems.FieldError` naming
   the field (the engines' own checks as its :class:`EngineInputError`) and changes nothing.
2. The call's samples (longest prompts first) join the engine's running batch
   (:mod:`arctic_platform.engine.running_batch`) through its decode loop
   (:mod:`arctic_platform.engine.decode_loop`): calls from several threads decode together, a
   call that arrives while others decode joins them at the next step (each distinct prompt
   prefilled once for all the samples that ask for it, between two decode steps, or copied from
   the prompt cache, :mod:`.prompt_cache`, when an earlier call prefilled it on the same
   weights; a prompt that starts like a cached one copies that start and prefills the rest),
   and each call returns as soon as its own
   sequences finish. The batch stays within ``max_batch_size`` rows and ``max_kv_cache_bytes``
   of cache; samples that do not fit wait for rows to free up, in arrival order.
3. ``load_weights``, ``sleep``, ``wake``, ``prompt_logprobs`` and ``reset_prefix_cache`` run
   alone: calls that arrived before them finish first, calls that arrive after them wait.

With ``continuous_batching: false`` calls run one at a time (the behaviour before the running
batch; the benchmark's baseline).

Sampling is described in :mod:`arctic_platform.engine.sampling_ops`. Reproducibility: a request
with a ``seed`` gets the same samples whatever else is in the batch (each sequence's random
numbers depend only on the seed, its sample index and its own step), also when it joins a batch
mid-decode. What is not promised is bitwise-identical logits across different batch shapes: if a
draw lands within float rounding of a probability boundary, the padding of another prompt could
flip it. Requests without a seed draw
one from the engine's generator (seeded by ``config.seed``), so a fixed sequence of calls repeats.

Outputs follow vLLM's conventions: ``token_ids`` include the token that stopped generation (an
end-of-sequence token or one of ``stop_token_ids``) and, for stop strings, every token generated
up to the one that completed the string; ``text`` excludes the stop token, and is cut before the
stop string, unless ``include_stop_str_in_output``. ``stop_reason`` is the stop string or stop
token id that ended the sequence (``None`` for end-of-sequence and for ``length``).

Sleep and wake: ``sleep(1)`` releases the KV cache buffers and the prompt cache; ``sleep(2)`` also
moves the weights to CPU memory when they live on an accelerator (on a CPU-only engine they stay
where they are, and the result says so) and drops the packed copies of CPU weights
(:mod:`.packed_linear`). ``wake`` restores what was released. ``generate`` on a sleeping engine
wakes it first (and logs a warning), so a missed wake call costs time, never a run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence

import torch

from arctic_platform.contract.sampling_params import SamplingParams
from arctic_platform.engine import packed_linear, shared_prefix
from arctic_platform.engine.config import SamplingEngineConfig
from arctic_platform.engine.decode_loop import DecodeLoop
from arctic_platform.engine.errors import EngineInputError, SamplerStateError
from arctic_platform.engine.forward import forward_no_grad, prepare_request
from arctic_platform.engine.kv_cache import KVBufferPool
from arctic_platform.engine.models import (
    kv_bytes_per_token,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
)
from arctic_platform.engine.prompt_cache import PromptCache
from arctic_platform.engine.running_batch import (
    LENGTH,
    STOP_ID,
    STOP_STR,
    Finished,
    ModelSide,
    RunningBatch,
    Slice,
)
from arctic_platform.engine.sampling_ops import seed_to_int64
from arctic_platform.engine.sampling_requests import (
    RequestShaper,
    SampleRequest,
    checked_max_model_len,
    model_context,
)
from arctic_platform.engine.stop_strings import find_new
from arctic_platform.engine.wake_tags import checked_wake_tags
from arctic_platform.engine.weights import WeightLoadError, load_into_model

log = logging.getLogger(__name__)


class SamplingEngine:
    """Generates completions from a causal LM (see the module docstring for the semantics)."""

    def __init__(self, config: SamplingEngineConfig) -> None:
        self.config = config
        # The sampler always holds plain weights; a LoRA trainer syncs its merged weights here.
        model_config = config.model.model_copy(update={"lora": None})
        self.device = resolve_device(model_config.device)
        self.model = load_causal_lm(model_config, self.device).eval().requires_grad_(False)
        shared_prefix.install(self.model)
        packed_linear.install(self.model)
        self.tokenizer = load_tokenizer(model_config)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_model_len = checked_max_model_len(
            config.max_model_len, model_context(self.model.config)
        )
        self.eos_token_ids = self._eos_ids()
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self._pool = KVBufferPool()
        self._shaper = RequestShaper(
            self.tokenizer, config, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        self._released: set[str] = set()
        self._weights_complete = True
        side = ModelSide(
            model=self.model,
            device=self.device,
            vocab_size=self.vocab_size,
            pad_token_id=self.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            num_layers=self._num_layers(),
            kv_bytes_per_token=self._kv_bytes_per_token(),
            tokenizer=self.tokenizer,
        )
        self._prompt_cache = PromptCache(
            self.model, config.prompt_cache_bytes, room=config.max_kv_cache_bytes
        )
        batch = RunningBatch(side, config, self._pool, self._prompt_cache)
        self._loop = DecodeLoop(batch, self._ready)
        self._validating = threading.Lock()  # the tokenizer and the seed stream, one call at a time
        self._one_call = threading.Lock()  # continuous_batching off: calls run one at a time

    @property
    def concurrent_generate(self) -> bool:
        """Whether calls from several threads decode together (the server then lets a sampling
        sub-job's generate ops overlap)."""
        return self.config.continuous_batching

    def batch_state(self) -> dict:
        """Rows decoding, calls running and waiting, joins so far (see ``DecodeLoop.state``),
        and the prompt cache's entries, bytes, hits, prefix hits and misses."""
        return {**self._loop.state(), "prompt_cache": self._prompt_cache.state()}

    # ------------------------------------------------------------------------------------------
    # generate

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: Mapping | SamplingParams | Sequence[Mapping | None] | None = None,
    ) -> list[dict]:
        """Complete every prompt ``n`` times; one output dict per prompt and sample, in order."""
        with self._validating:
            requests = self._validate(prompts, sampling_params)
            self._check_weights()
            self._shaper.assign_seeds(requests)  # only now: a rejected call leaves the stream
        offsets, total = {}, 0
        for request in requests:
            request.seed = seed_to_int64(request.seed)
            offsets[request.index] = total
            total += request.params.n
        slices = [
            Slice(None, r, 0, r.params.n) for r in sorted(requests, key=lambda r: -len(r.token_ids))
        ]
        if self.config.continuous_batching:
            finished = self._loop.run(slices, offsets, total)
        else:
            with self._one_call:
                finished = self._loop.run(slices, offsets, total)
        return [self._output(done) for done in finished]

    def _check_weights(self) -> None:
        if not self._weights_complete:
            raise SamplerStateError(
                "the last load_weights failed part-way, so the weights are a mix of old and new; "
                "run a complete weight sync before generating"
            )

    def _ready(self) -> None:
        """Before samples join an empty batch (the loop's driver, nothing else running)."""
        self._check_weights()
        if self._released:
            log.warning("generate() on a sleeping sampler: waking it (%s)", sorted(self._released))
            self._wake(None)

    def _validate(self, prompts, sampling_params) -> list[SampleRequest]:
        requests = self._shaper.validate(prompts, sampling_params)
        per_token = self._kv_bytes_per_token()
        for request in requests:
            length = len(request.token_ids) + request.max_new
            if length * per_token > self.config.max_kv_cache_bytes:
                raise EngineInputError(
                    f"prompts[{request.index}]",
                    f"one sequence of {length} tokens needs more KV cache than "
                    f"max_kv_cache_bytes={self.config.max_kv_cache_bytes} (a job's "
                    "sampling.vllm.kv_cache_memory_bytes)",
                )
        return requests

    def _output(self, done: Finished) -> dict:
        """The output dict of one finished sequence (vLLM's conventions, module doc)."""
        params = done.request.params
        ids = done.token_ids
        text, stop_reason = self._text(ids, done.reason, done.stop_string, params)
        output = {
            "text": text,
            "token_ids": ids,
            "finish_reason": "length" if done.reason == LENGTH else "stop",
            "stop_reason": stop_reason,
            "prompt_len": len(done.request.token_ids),
            "prompt_index": done.request.index,
            "sample_index": done.sample,
            "cached_prompt_tokens": done.cached_tokens,
        }
        if params.logprobs is not None:
            output["logprobs"] = [
                {"token_id": token, "logprob": logprob, "rank": rank, "top": top}
                for token, logprob, rank, top in zip(
                    ids, done.logprobs, done.ranks, done.top, strict=True
                )
            ]
        return output

    def _text(self, ids: list[int], why: int, stop_string, params: SamplingParams):
        """The output text under vLLM's rules, and the stop reason (string, token id or None)."""
        keep_stop = params.include_stop_str_in_output
        if why == STOP_ID:
            last = ids[-1]
            text = self._decode(ids if keep_stop else ids[:-1], params)
            return text, (last if last in params.stop_token_ids else None)
        text = self._decode(ids, params)
        if why == STOP_STR:
            before = self._decode(ids[:-1], params)
            start = find_new(stop_string, text, before)
            if start < 0:  # decoding was not prefix-stable; fall back to the first occurrence
                start = text.find(stop_string)
            end = start + len(stop_string) if keep_stop else start
            return text[:end], stop_string
        return text, None

    def _decode(self, ids: list[int], params: SamplingParams) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    # ------------------------------------------------------------------------------------------
    # weights, sleep and wake

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping) -> dict:
        """Copy weights (plain ``transformers`` names) into the model in place.

        A mapping or a list is validated entirely before anything is written; a stream from
        :func:`~arctic_platform.engine.weights.iter_weights_from_chunks` or an export from
        :func:`~arctic_platform.engine.weights.export_weights` has its manifest validated first and
        each chunk validated before it is copied; a plain iterator is validated tensor by tensor.
        If a failure is only detected after some tensors were written, the engine refuses to
        generate until a later load writes every weight of the model. Works while asleep (the
        weights are wherever sleep left them). Returns ``{"tensors", "bytes", "complete"}``.
        Waits for the calls decoding now (they finish on the old weights); calls that arrive
        while it waits or runs decode on the new ones.
        """
        return self._loop.exclusive(lambda: self._load_weights(named_tensors))

    def _load_weights(self, named_tensors) -> dict:
        self._prompt_cache.clear()
        try:
            report = load_into_model(self.model, named_tensors)
        except WeightLoadError as err:
            if err.applied:
                self._weights_complete = False
            raise
        finally:
            packed_linear.refresh(self.model)
        if report["complete"]:
            self._weights_complete = True
        return report

    def sleep(self, level: int = 1) -> dict:
        """Release the KV cache (level 1); level 2 also offloads the weights from an accelerator
        and drops the packed copies of CPU weights (``packed_linear.release``)."""
        if isinstance(level, bool) or level not in (1, 2):
            raise EngineInputError("level", f"must be 1 or 2, got {level!r}")
        return self._loop.exclusive(lambda: self._sleep(level))

    def _sleep(self, level: int) -> dict:
        result = {
            "level": level,
            "kv_cache_bytes_released": self._pool.release(),
            "prompt_cache_bytes_released": self._prompt_cache.clear()["bytes_released"],
        }
        self._released.add("kv_cache")
        if level == 2:
            result["packed_weight_bytes_released"] = packed_linear.release(self.model)
            if self.device.type == "cpu":
                result["weights"] = "kept: the engine runs on CPU, there is no device to free"
            elif "weights" not in self._released:
                self.model.to("cpu")
                self._released.add("weights")
                result["weights"] = "offloaded to CPU memory"
            else:
                result["weights"] = "already offloaded"
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        result["asleep"] = sorted(self._released)
        return result

    def wake(self, tags: Sequence[str] | None = None) -> dict:
        """Restore what sleep released: ``tags`` is a subset of ``["weights", "kv_cache"]``."""
        tags = checked_wake_tags(tags)
        return self._loop.exclusive(lambda: self._wake(tags))

    def _wake(self, tags: Sequence[str] | None) -> dict:
        tags = checked_wake_tags(tags)
        woke = []
        if "weights" in tags and "weights" in self._released:
            self.model.to(self.device)
            self._released.discard("weights")
            woke.append("weights")
        if "kv_cache" in tags and "kv_cache" in self._released:
            self._pool.reserve()
            self._released.discard("kv_cache")
            woke.append("kv_cache")
        return {"woke": woke, "kv_cache_bytes": self._pool.nbytes, "asleep": sorted(self._released)}

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float | None]:
        """Each prompt token's log-prob given the tokens before it (None for the first), as
        vLLM's ``prompt_logprobs``; scored by the path the training engine scores with."""
        return self._loop.exclusive(lambda: self._prompt_logprobs(token_ids))

    def _prompt_logprobs(self, token_ids: Sequence[int]) -> list[float | None]:
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        request = prepare_request(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            None,
            None,
            vocab_size=self.vocab_size,
            max_tokens=self.config.max_tokens_per_microbatch,
            packing=False,
            default_loss=None,
            max_seq_len=self.max_model_len,
        )
        with packed_linear.bypassed():  # the trainer's products, as the docstring promises
            scored = forward_no_grad(self.model, request, self.device)["logprobs"][0]
        return [None, *(float(v) for v in scored[1:])]

    def reset_prefix_cache(self) -> dict:
        """Drop the prompt cache (:mod:`.prompt_cache`): ``{"cached_prefixes", "bytes_released"}``.
        Runs after the calls decoding now, as a weight load does."""
        return self._loop.exclusive(self._prompt_cache.clear)

    def close(self) -> None:
        """Nothing to release outside this process: the model goes with the engine."""

    # ------------------------------------------------------------------------------------------

    def _eos_ids(self) -> tuple[int, ...]:
        for source in (self.model.generation_config, self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,)

    def _num_layers(self) -> int:
        return self.model.config.get_text_config().num_hidden_layers

    def _kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model.config, self.model.dtype)
