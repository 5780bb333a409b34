"""SamplingEngine: generation with continuous batching over a KV cache, the torch ``generate`` op.

How a call runs:

1. Everything is validated first, on the caller's thread (prompts, every sampling parameter,
   context lengths, the cache budget); a bad request raises :class:`EngineInputError` naming the
   field and changes nothing.
2. :meth:`SamplingEngine.submit` hands the call to the engine core
   (:mod:`arctic_platform.engine.sampler_core`) and returns a future; :meth:`generate` is
   submit-and-wait, so every caller keeps its interface. The core decodes all running sequences
   together, one batched forward per step: a call that arrives while others decode joins at the
   next step (its prompts prefilled between two steps, each distinct prompt once for all its
   ``n`` samples), and finished sequences leave at once, giving their KV rows to the next join
   (:mod:`arctic_platform.engine.kv_cache`). Prefill forwards hold at most
   ``max_tokens_per_microbatch`` padded tokens; at most ``max_batch_size`` sequences run at once
   and their KV cache stays within ``max_kv_cache_bytes`` (a call waits at the queue's head until
   rows are free; a request whose ``n`` does not fit at once joins in parts).
3. Ops that change the engine (``load_weights``, ``sleep``, ``wake``) run between calls: each
   waits until every call submitted before it has finished, and calls submitted meanwhile wait
   for it. So a sequence never decodes with a mix of weight versions.

Sampling is described in :mod:`arctic_platform.engine.sampling_ops`. Reproducibility: a request
with a ``seed`` gets the same samples whatever else is batched with it, and whenever it joins
(each sequence's random numbers depend only on the seed, its sample index and its own step).
What is not promised is bitwise-identical logits across different batch shapes: if a draw lands
within float rounding of a probability boundary, the padding of another prompt could flip it.
Requests without a seed draw one from the engine's generator (seeded by ``config.seed``) when
they are submitted, so a fixed sequence of calls repeats.

Outputs follow vLLM's conventions: ``token_ids`` include the token that stopped generation (an
end-of-sequence token or one of ``stop_token_ids``) and, for stop strings, every token generated
up to the one that completed the string; ``text`` excludes the stop token, and is cut before the
stop string, unless ``include_stop_str_in_output``. ``stop_reason`` is the stop string or stop
token id that ended the sequence (``None`` for end-of-sequence and for ``length``).

Sleep and wake: ``sleep(1)`` releases the KV cache buffers; ``sleep(2)`` also moves the weights to
CPU memory when they live on an accelerator (on a CPU-only engine they stay where they are, and
the result says so). ``wake`` restores what was released. ``generate`` on a sleeping engine wakes
it first (and logs a warning), so a missed wake call costs time, never a run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from arctic_platform.engine.config import SamplingEngineConfig
from arctic_platform.engine.errors import EngineInputError, SamplerStateError
from arctic_platform.engine.forward import forward_no_grad, prepare_request
from arctic_platform.engine.kv_cache import KVCache
from arctic_platform.engine.kv_shape import KVShape
from arctic_platform.engine.models import load_causal_lm, load_tokenizer, resolve_device
from arctic_platform.engine.sampler_core import (
    LENGTH,
    STOP_ID,
    STOP_STR,
    GenerateFuture,
    SamplerCore,
    find_new,
)
from arctic_platform.engine.sampler_core import Sequence as RunningSequence
from arctic_platform.engine.sampling_ops import seed_to_int64
from arctic_platform.engine.sampling_params import SamplingParams
from arctic_platform.engine.sampling_requests import (
    RequestShaper,
    SampleRequest,
    checked_max_model_len,
    model_context,
)
from arctic_platform.engine.wake_tags import checked_wake_tags
from arctic_platform.engine.weights import WeightLoadError, load_into_model

log = logging.getLogger(__name__)


class SamplingEngine:
    """Generates completions from a causal LM (see the module docstring for the semantics)."""

    # Concurrent generate calls are safe and batch together (the Service lets them overlap).
    concurrent_generate = True

    def __init__(self, config: SamplingEngineConfig) -> None:
        self.config = config
        # The sampler always holds plain weights; a LoRA trainer syncs its merged weights here.
        model_config = config.model.model_copy(update={"lora": None})
        self.device = resolve_device(model_config.device)
        self.model = load_causal_lm(model_config, self.device).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(model_config)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_model_len = checked_max_model_len(
            config.max_model_len, model_context(self.model.config)
        )
        self.eos_token_ids = self._eos_ids()
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self._shaper = RequestShaper(
            self.tokenizer, config, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        self._released: set[str] = set()
        self._weights_complete = True
        self.core = SamplerCore(self, KVCache(self._kv_shape(), self.device))
        # The gate between calls and the ops that change the engine (module doc, point 3).
        self._gate = threading.Condition()
        self._calls = 0  # submitted and not finished
        self._exclusive = False
        self._exclusive_waiting = 0

    # ------------------------------------------------------------------------------------------
    # generate

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: Mapping | SamplingParams | Sequence[Mapping | None] | None = None,
    ) -> list[dict]:
        """Complete every prompt ``n`` times; one output dict per prompt and sample, in order."""
        return self.submit(prompts, sampling_params).result()

    def submit(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: Mapping | SamplingParams | Sequence[Mapping | None] | None = None,
    ) -> GenerateFuture:
        """Validate a call and hand it to the engine core; the future resolves to what
        :meth:`generate` returns, or fails with ``OpCancelled`` when the caller's cancel scope
        (:mod:`~arctic_platform.engine.cancellation`) is cancelled before it finishes."""
        requests = self._validate(prompts, sampling_params)
        if self._released:
            log.warning("generate() on a sleeping sampler: waking it (%s)", sorted(self._released))
            self.wake()
        with self._gate:
            while self._exclusive or self._exclusive_waiting:
                self._gate.wait()
            if not self._weights_complete:
                raise SamplerStateError(
                    "the last load_weights failed part-way, so the weights are a mix of old and "
                    "new; run a complete weight sync before generating"
                )
            self._shaper.assign_seeds(requests)  # only now: a rejected call leaves the stream
            for request in requests:
                request.seed = seed_to_int64(request.seed)
            self._calls += 1
        try:
            future = self.core.submit(requests)
        except BaseException:
            self._call_done()
            raise
        future.add_done_callback(lambda _: self._call_done())
        return future

    def close(self) -> None:
        """Stop the engine core (calls still queued or running fail with ``OpCancelled``)."""
        self.core.close()

    @contextlib.contextmanager
    def _as_call(self) -> Iterator[None]:
        """Run the body (a forward on this thread) as a call: ops that change the engine wait."""
        with self._gate:
            while self._exclusive or self._exclusive_waiting:
                self._gate.wait()
            self._calls += 1
        try:
            yield
        finally:
            self._call_done()

    def _call_done(self) -> None:
        with self._gate:
            self._calls -= 1
            self._gate.notify_all()

    @contextlib.contextmanager
    def _between_calls(self) -> Iterator[None]:
        """Run the body when no call is queued or running; calls submitted meanwhile wait."""
        with self._gate:
            self._exclusive_waiting += 1
            try:
                while self._exclusive or self._calls:
                    self._gate.wait()
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._gate:
                self._exclusive = False
                self._gate.notify_all()

    def _validate(self, prompts, sampling_params) -> list[SampleRequest]:
        requests = self._shaper.validate(prompts, sampling_params)
        per_token = self._kv_shape().bytes_per_token
        for request in requests:
            length = len(request.token_ids) + request.max_new
            if length * per_token > self.config.max_kv_cache_bytes:
                raise EngineInputError(
                    f"prompts[{request.index}]",
                    f"one sequence of {length} tokens needs more KV cache than "
                    f"max_kv_cache_bytes={self.config.max_kv_cache_bytes}",
                )
        return requests

    # ------------------------------------------------------------------------------------------
    # the model runner: what the engine core calls, on its thread

    def prefill(self, cache: KVCache, prompts: list[tuple[list[int], int]]) -> torch.Tensor:
        """Prefill each ``(prompt, count)`` once into ``count`` new rows after the rows in use;
        return the new rows' first-step logits ``[rows, vocab]`` (float32)."""
        device = self.device
        counts = torch.tensor([count for _, count in prompts])
        first_row = cache.active
        row_start = first_row + torch.cumsum(counts, 0) - counts
        logits = torch.empty(int(counts.sum()), self.vocab_size, device=device)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i][0]))
        start = 0
        while start < len(order):
            width = len(prompts[order[start]][0])
            per_batch = max(1, self.config.max_tokens_per_microbatch // width)
            pieces = order[start : start + per_batch]
            start += len(pieces)
            ids = torch.full((len(pieces), width), self.pad_token_id, dtype=torch.long)
            attention = torch.zeros(len(pieces), width, dtype=torch.bool)
            positions = torch.zeros(len(pieces), width, dtype=torch.long)
            rows, source, lengths = [], [], []
            for i, piece in enumerate(pieces):
                prompt, count = prompts[piece]
                ids[i, width - len(prompt) :] = torch.tensor(prompt)
                attention[i, width - len(prompt) :] = True
                positions[i, width - len(prompt) :] = torch.arange(len(prompt))
                rows += range(int(row_start[piece]), int(row_start[piece]) + count)
                source += [i] * count
                lengths += [len(prompt)] * count
            rows_t = torch.tensor(rows, device=device)
            source_t = torch.tensor(source, device=device)
            padded = not bool(attention.all())
            with cache.prefill_rows(rows_t, source_t, lengths, width):
                out = self.model(
                    input_ids=ids.to(device),
                    attention_mask=attention.to(device) if padded else None,
                    position_ids=positions.to(device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            logits[rows_t - first_row] = out.logits[:, -1].float()[source_t]
        lengths = torch.tensor([len(p) for p, _ in prompts]).repeat_interleave(counts)
        cache.joined(lengths)
        return logits

    def decode(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step for every running row; the next logits ``[rows, vocab]``."""
        out = self.model(
            input_ids=tokens[:, None],
            position_ids=cache.lengths[:, None],
            attention_mask=cache.attention_mask(),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()

    def suppression(self, stop_ids: torch.Tensor, early: torch.Tensor) -> torch.Tensor | None:
        """Stop tokens each row may not pick yet (rows ``early`` are below ``min_tokens``), as a
        ``[rows, vocab]`` mask; None when no row has one to suppress."""
        need = early[:, None] & (stop_ids >= 0)
        if stop_ids.shape[1] == 0 or not bool(need.any()):
            return None
        index = torch.where(need, stop_ids, self.vocab_size)
        mask = torch.zeros(len(stop_ids), self.vocab_size + 1, dtype=torch.bool, device=self.device)
        return mask.scatter_(1, index, True)[:, : self.vocab_size]

    def output(self, seq: RunningSequence) -> dict:
        """The output dict of a finished sequence (vLLM's conventions, module doc)."""
        params, ids = seq.request.params, seq.tokens
        text, stop_reason = self._text(ids, seq.reason, seq.stop_string, params)
        output = {
            "text": text,
            "token_ids": ids,
            "finish_reason": "length" if seq.reason == LENGTH else "stop",
            "stop_reason": stop_reason,
            "prompt_len": len(seq.request.token_ids),
            "prompt_index": seq.request.index,
            "sample_index": seq.sample,
        }
        if params.logprobs is not None:
            output["logprobs"] = [
                {"token_id": token, "logprob": value, "rank": rank, "top": top}
                for token, (value, rank, top) in zip(ids, seq.logprobs, strict=True)
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
        weights are wherever sleep left them). Runs between calls (module doc): it waits for the
        calls already submitted, and later ones wait for it. Returns ``{"tensors", "bytes",
        "complete"}``.
        """
        with self._between_calls():
            try:
                report = load_into_model(self.model, named_tensors)
            except WeightLoadError as err:
                if err.applied:
                    self._weights_complete = False
                raise
            if report["complete"]:
                self._weights_complete = True
            return report

    def sleep(self, level: int = 1) -> dict:
        """Release the KV cache (level 1) and also offload the weights from an accelerator (2)."""
        if isinstance(level, bool) or level not in (1, 2):
            raise EngineInputError("level", f"must be 1 or 2, got {level!r}")
        with self._between_calls():
            return self._sleep(level)

    def _sleep(self, level: int) -> dict:
        result = {"level": level, "kv_cache_bytes_released": self.core.cache.release()}
        self._released.add("kv_cache")
        if level == 2:
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
        with self._between_calls():
            woke = []
            if "weights" in tags and "weights" in self._released:
                self.model.to(self.device)
                self._released.discard("weights")
                woke.append("weights")
            if "kv_cache" in tags and "kv_cache" in self._released:
                self.core.cache.reserve()
                self._released.discard("kv_cache")
                woke.append("kv_cache")
            cache_bytes = self.core.cache.nbytes
        return {"woke": woke, "kv_cache_bytes": cache_bytes, "asleep": sorted(self._released)}

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float | None]:
        """Each prompt token's log-prob given the tokens before it (None for the first), as
        vLLM's ``prompt_logprobs``; scored by the path the training engine scores with."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        request = prepare_request(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            None,
            None,
            vocab_size=self.vocab_size,
            max_tokens=self.config.max_tokens_per_microbatch,
            packing=False,
            default_loss=None,
        )
        with self._as_call():
            scored = forward_no_grad(self.model, request, self.device)["logprobs"][0]
        return [None, *(float(v) for v in scored[1:])]

    def reset_prefix_cache(self) -> dict:
        """No prompt cache outlives a call (a prompt's samples share its prefill within one call),
        so there is nothing to drop; the result says so."""
        return {"cached_prefixes": 0, "note": "no prefix cache is kept across generate calls"}

    # ------------------------------------------------------------------------------------------

    def _eos_ids(self) -> tuple[int, ...]:
        for source in (self.model.generation_config, self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,)

    def _kv_shape(self) -> KVShape:
        return KVShape.of(self.model.config, self.model.dtype)
