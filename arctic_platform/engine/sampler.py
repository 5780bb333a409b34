"""SamplingEngine: batched generation with a KV cache, the torch backend of the ``generate`` op.

How a call runs:

1. Everything is validated first (prompts, every sampling parameter, context lengths, the cache
   budget); a bad request raises a :class:`~arctic_platform.contract.problems.FieldError` naming
   the field (the engines' own checks as its :class:`EngineInputError`) and changes nothing.
2. Requests are sorted by prompt length and packed into *waves* of at most ``max_batch_size``
   sequences whose key/value cache fits ``max_kv_cache_bytes`` (a request whose ``n`` does not
   fit one wave is split, and each part prefills its prompt again).
3. In a wave, each distinct prompt is prefilled **once** (left-padded to the wave's widest prompt,
   in microbatches of at most ``max_tokens_per_microbatch`` padded tokens) and its keys/values are
   written into the rows of all its ``n`` samples (:mod:`arctic_platform.engine.kv_cache`).
4. Decoding is one batched forward per step over the sequences still running, with per-row
   position ids. A finished sequence keeps its row (its further tokens are discarded) until an
   eighth of the rows are finished; then the cache and all row state are compacted, so the work
   per step tracks the live sequences without paying a compaction for every single finish.

Sampling is described in :mod:`arctic_platform.engine.sampling_ops`. Reproducibility: a request
with a ``seed`` gets the same samples whatever else is in the batch or wave (each sequence's
random numbers depend only on the seed, its sample index and the step). What is not promised is
bitwise-identical logits across different batch shapes: if a draw lands within float rounding of a
probability boundary, the padding of another prompt could flip it. Requests without a seed draw
one from the engine's generator (seeded by ``config.seed``), so a fixed sequence of calls repeats.

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

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from arctic_platform.contract.sampling_params import SamplingParams
from arctic_platform.engine import cancellation
from arctic_platform.engine.config import SamplingEngineConfig
from arctic_platform.engine.errors import EngineInputError, SamplerStateError
from arctic_platform.engine.forward import forward_no_grad, prepare_request
from arctic_platform.engine.kv_cache import KVBufferPool, KVCache
from arctic_platform.engine.models import (
    kv_bytes_per_token,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
)
from arctic_platform.engine.sampling_ops import (
    choose_tokens,
    seed_to_int64,
    sequence_keys,
    step_uniforms,
)
from arctic_platform.engine.sampling_requests import (
    RequestShaper,
    SampleRequest,
    checked_max_model_len,
    model_context,
)
from arctic_platform.engine.wake_tags import checked_wake_tags
from arctic_platform.engine.weights import WeightLoadError, load_into_model

log = logging.getLogger(__name__)

_STOP_ID, _STOP_STR, _LENGTH = 1, 2, 3
# Tokens decoded around the newest one when looking for stop strings, beyond the string's length.
_STOP_WINDOW_SLACK = 8


@dataclass
class _Slice:
    """Samples ``first .. first + count - 1`` of a request, decoded in one wave."""

    request: SampleRequest
    first: int
    count: int


class SamplingEngine:
    """Generates completions from a causal LM (see the module docstring for the semantics)."""

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
        self._pool = KVBufferPool()
        self._shaper = RequestShaper(
            self.tokenizer, config, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        self._released: set[str] = set()
        self._weights_complete = True

    # ------------------------------------------------------------------------------------------
    # generate

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: Mapping | SamplingParams | Sequence[Mapping | None] | None = None,
    ) -> list[dict]:
        """Complete every prompt ``n`` times; one output dict per prompt and sample, in order."""
        requests = self._validate(prompts, sampling_params)
        if not self._weights_complete:
            raise SamplerStateError(
                "the last load_weights failed part-way, so the weights are a mix of old and new; "
                "run a complete weight sync before generating"
            )
        if self._released:
            log.warning("generate() on a sleeping sampler: waking it (%s)", sorted(self._released))
            self.wake()
        self._shaper.assign_seeds(requests)  # only now: a rejected call leaves the stream as is
        for request in requests:
            request.seed = seed_to_int64(request.seed)
        offsets, total = [], 0
        for request in requests:
            offsets.append(total)
            total += request.params.n
        outputs: list[dict | None] = [None] * total
        with torch.inference_mode():
            for wave in self._plan_waves(requests):
                for piece, sample, output in self._run_wave(wave):
                    outputs[offsets[piece.request.index] + sample] = output
        return outputs

    def _validate(self, prompts, sampling_params) -> list[SampleRequest]:
        requests = self._shaper.validate(prompts, sampling_params)
        per_token = self._kv_bytes_per_token()
        for request in requests:
            length = len(request.token_ids) + request.max_new
            if length * per_token > self.config.max_kv_cache_bytes:
                raise EngineInputError(
                    f"prompts[{request.index}]",
                    f"one sequence of {length} tokens needs more KV cache than "
                    f"max_kv_cache_bytes={self.config.max_kv_cache_bytes}",
                )
        return requests

    def _plan_waves(self, requests: list[SampleRequest]) -> list[list[_Slice]]:
        """Pack requests (longest prompts first) into waves within the batch and cache limits."""
        per_token = self._kv_bytes_per_token()
        waves: list[list[_Slice]] = []
        current: list[_Slice] = []
        rows = width = new = 0
        for request in sorted(requests, key=lambda r: -len(r.token_ids)):
            first = 0
            while first < request.params.n:
                w = max(width, len(request.token_ids))
                m = max(new, request.max_new)
                by_memory = self.config.max_kv_cache_bytes // ((w + m) * per_token)
                room = min(self.config.max_batch_size, by_memory) - rows
                if room <= 0:
                    waves.append(current)
                    current, rows, width, new = [], 0, 0, 0
                    continue
                count = min(room, request.params.n - first)
                current.append(_Slice(request, first, count))
                rows, width, new, first = rows + count, w, m, first + count
        if current:
            waves.append(current)
        return waves

    def _run_wave(self, wave: list[_Slice]):
        """Decode one wave; yield ``(slice, sample index, output dict)`` for each sequence."""
        device = self.device
        counts = torch.tensor([s.count for s in wave])
        rows_total = int(counts.sum())
        width = max(len(s.request.token_ids) for s in wave)
        max_new = max(s.request.max_new for s in wave)
        cache = KVCache(self._num_layers(), rows_total, width + max_new, self._pool)
        state = self._row_state(wave, counts, device)
        mask = torch.ones(rows_total, width + max_new, dtype=torch.bool, device=device)
        logits = self._prefill(wave, counts, width, cache, mask)
        cache.start_decoding(width)
        # Without padding (equal prompt lengths, or n samples of one prompt) every key is
        # visible: no mask lets attention skip building and applying one at every step.
        padded = not bool(mask[:, :width].all())

        tokens_out = torch.zeros(rows_total, max_new, dtype=torch.long, device=device)
        n_out = torch.zeros(rows_total, dtype=torch.long, device=device)
        reason = torch.zeros(rows_total, dtype=torch.int8, device=device)
        logprob_k = max((s.request.params.logprobs or 0) for s in wave)
        wants_logprobs = any(s.request.params.logprobs is not None for s in wave)
        lp_out = torch.zeros(rows_total, max_new, device=device) if wants_logprobs else None
        rank_out = (
            torch.zeros(rows_total, max_new, dtype=torch.long, device=device)
            if wants_logprobs
            else None
        )
        top_out = (
            (
                torch.zeros(rows_total, max_new, logprob_k, dtype=torch.long, device=device),
                torch.zeros(rows_total, max_new, logprob_k, device=device),
            )
            if wants_logprobs and logprob_k
            else None
        )
        watcher = _StopStringWatcher(self.tokenizer, wave, counts)
        max_min_tokens = max(s.request.params.min_tokens for s in wave)
        done = torch.zeros(rows_total, dtype=torch.bool, device=device)
        for step in range(max_new):
            cancellation.check()  # between decode steps: a cancelled op stops here
            suppress = self._suppression(state, step) if step < max_min_tokens else None
            tokens, scaled = choose_tokens(
                logits,
                greedy=state["greedy"],
                temperature=state["temperature"],
                top_k=state["top_k"],
                top_p=state["top_p"],
                min_p=state["min_p"],
                uniforms=step_uniforms(state["keys"], step),
                suppress=suppress,
            )
            slot = state["slot"]
            tokens_out[slot, step] = tokens
            if lp_out is not None:
                log_probs = torch.log_softmax(scaled, dim=-1)
                chosen = log_probs.gather(1, tokens[:, None])
                lp_out[slot, step] = chosen.squeeze(1)
                rank_out[slot, step] = (log_probs > chosen).sum(1) + 1  # vLLM's 1-based rank
                if top_out is not None:
                    values, ids = log_probs.topk(logprob_k, dim=-1)
                    top_out[0][slot, step] = ids
                    top_out[1][slot, step] = values
            hit_id = (tokens[:, None] == state["stop_ids"]).any(dim=1) & ~done
            hit_len = (step + 1 >= state["max_new"]) & ~done & ~hit_id
            hit_str = watcher.check(tokens_out, state["slot"], done | hit_id, step)
            hit_len &= ~hit_str
            finished = hit_id | hit_str | hit_len
            reason[slot] = torch.where(
                hit_id,
                _STOP_ID,
                torch.where(hit_str, _STOP_STR, torch.where(hit_len, _LENGTH, reason[slot])),
            ).to(torch.int8)
            n_out[slot[finished]] = step + 1
            done |= finished
            n_done = int(done.sum())
            if n_done == len(done):
                break
            if n_done >= max(1, len(done) // 8):
                keep = (~done).nonzero().squeeze(1)
                cache.keep_rows(keep)
                state = {k: v[keep] for k, v in state.items()}
                mask = mask[keep]
                done = done[keep]
                tokens = tokens[keep]
            out = self.model(
                input_ids=tokens[:, None],
                position_ids=state["position"][:, None],
                attention_mask=mask[:, : width + step + 1] if padded else None,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1].float()
            state["position"] += 1
        yield from self._outputs(
            wave, tokens_out, n_out, reason, (lp_out, rank_out), top_out, watcher.matched
        )

    def _row_state(self, wave: list[_Slice], counts: torch.Tensor, device) -> dict:
        """Per-row tensors (one row per sequence), compacted together as sequences finish."""
        per_slice = []
        for piece in wave:
            p, r = piece.request.params, piece.request
            stop_ids = () if p.ignore_eos else tuple(self.eos_token_ids)
            stop_ids += tuple(t for t in p.stop_token_ids if t not in stop_ids)
            per_slice.append((p, r, stop_ids))
        width = max((len(s) for _, _, s in per_slice), default=0)
        stop_ids = torch.full((len(wave), width), -1, dtype=torch.long)
        for i, (_, _, ids) in enumerate(per_slice):
            stop_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype).repeat_interleave(counts)

        sample_index = torch.cat([torch.arange(s.first, s.first + s.count) for s in wave])
        seeds = column([r.seed for _, r, _ in per_slice], torch.long)
        state = {
            "slot": torch.arange(int(counts.sum())),
            "position": column([len(r.token_ids) for _, r, _ in per_slice], torch.long),
            "greedy": column([p.greedy for p, _, _ in per_slice], torch.bool),
            "temperature": column([p.temperature for p, _, _ in per_slice], torch.float32),
            "top_k": column([p.top_k for p, _, _ in per_slice], torch.long),
            "top_p": column([p.top_p for p, _, _ in per_slice], torch.float32),
            "min_p": column([p.min_p for p, _, _ in per_slice], torch.float32),
            "max_new": column([r.max_new for _, r, _ in per_slice], torch.long),
            "min_tokens": column([p.min_tokens for p, _, _ in per_slice], torch.long),
            "keys": sequence_keys(seeds, sample_index),
            "stop_ids": stop_ids.repeat_interleave(counts, dim=0),
        }
        return {k: v.to(device) for k, v in state.items()}

    def _prefill(self, wave, counts, width, cache: KVCache, mask: torch.Tensor) -> torch.Tensor:
        """Run each distinct prompt once; return first-step logits ``[rows, vocab]`` (float32)."""
        device = self.device
        row_start = torch.cumsum(counts, 0) - counts
        logits = torch.empty(int(counts.sum()), self.vocab_size, device=device)
        per_batch = max(1, self.config.max_tokens_per_microbatch // width)
        for start in range(0, len(wave), per_batch):
            pieces = wave[start : start + per_batch]
            ids = torch.full((len(pieces), width), self.pad_token_id, dtype=torch.long)
            attention = torch.zeros(len(pieces), width, dtype=torch.bool)
            positions = torch.zeros(len(pieces), width, dtype=torch.long)
            for i, piece in enumerate(pieces):
                prompt = piece.request.token_ids
                ids[i, width - len(prompt) :] = torch.tensor(prompt)
                attention[i, width - len(prompt) :] = True
                positions[i, width - len(prompt) :] = torch.arange(len(prompt))
            local_counts = counts[start : start + len(pieces)]
            source = torch.arange(len(pieces)).repeat_interleave(local_counts)
            rows = torch.cat(
                [
                    torch.arange(int(row_start[start + i]), int(row_start[start + i] + c))
                    for i, c in enumerate(local_counts.tolist())
                ]
            )
            rows, source = rows.to(device), source.to(device)
            mask[rows, :width] = attention.to(device)[source]
            with cache.prefill_rows(rows, source):
                out = self.model(
                    input_ids=ids.to(device),
                    attention_mask=attention.to(device),
                    position_ids=positions.to(device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            logits[rows] = out.logits[:, -1].float()[source]
        return logits

    def _suppression(self, state: dict, step: int) -> torch.Tensor | None:
        """Stop tokens each row may not pick yet (``min_tokens``), as a ``[rows, vocab]`` mask."""
        stop_ids = state["stop_ids"]
        need = (step < state["min_tokens"])[:, None] & (stop_ids >= 0)
        if stop_ids.shape[1] == 0 or not bool(need.any()):
            return None
        index = torch.where(need, stop_ids, self.vocab_size)
        mask = torch.zeros(len(stop_ids), self.vocab_size + 1, dtype=torch.bool, device=self.device)
        return mask.scatter_(1, index, True)[:, : self.vocab_size]

    def _outputs(self, wave, tokens_out, n_out, reason, sampled, top_out, matched):
        tokens_out, n_out, reason = tokens_out.cpu(), n_out.tolist(), reason.tolist()
        lp_out, rank_out = (t.cpu() if t is not None else None for t in sampled)
        top_ids, top_lp = (top_out[0].cpu(), top_out[1].cpu()) if top_out is not None else (0, 0)
        slot = 0
        for piece in wave:
            params = piece.request.params
            for sample in range(piece.first, piece.first + piece.count):
                n = n_out[slot]
                ids = tokens_out[slot, :n].tolist()
                text, stop_reason = self._text(ids, reason[slot], matched.get(slot), params)
                output = {
                    "text": text,
                    "token_ids": ids,
                    "finish_reason": "length" if reason[slot] == _LENGTH else "stop",
                    "stop_reason": stop_reason,
                    "prompt_len": len(piece.request.token_ids),
                    "prompt_index": piece.request.index,
                    "sample_index": sample,
                }
                if params.logprobs is not None:
                    k = params.logprobs
                    output["logprobs"] = [
                        {
                            "token_id": ids[t],
                            "logprob": float(lp_out[slot, t]),
                            "rank": int(rank_out[slot, t]),
                            "top": [
                                [int(i), float(v)]
                                for i, v in zip(
                                    top_ids[slot, t, :k], top_lp[slot, t, :k], strict=True
                                )
                            ]
                            if k
                            else [],
                        }
                        for t in range(n)
                    ]
                yield piece, sample, output
                slot += 1

    def _text(self, ids: list[int], why: int, stop_string, params: SamplingParams):
        """The output text under vLLM's rules, and the stop reason (string, token id or None)."""
        keep_stop = params.include_stop_str_in_output
        if why == _STOP_ID:
            last = ids[-1]
            text = self._decode(ids if keep_stop else ids[:-1], params)
            return text, (last if last in params.stop_token_ids else None)
        text = self._decode(ids, params)
        if why == _STOP_STR:
            before = self._decode(ids[:-1], params)
            start = _find_new(stop_string, text, before)
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
        """
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
        result = {"level": level, "kv_cache_bytes_released": self._pool.release()}
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
        scored = forward_no_grad(self.model, request, self.device)["logprobs"][0]
        return [None, *(float(v) for v in scored[1:])]

    def reset_prefix_cache(self) -> dict:
        """No prompt cache outlives a call (a prompt's samples share its prefill within one call),
        so there is nothing to drop; the result says so."""
        return {"cached_prefixes": 0, "note": "no prefix cache is kept across generate calls"}

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


class _StopStringWatcher:
    """Finds stop strings as they complete, only for the rows whose request has some.

    A string counts when an occurrence ends in the newest token's text (as vLLM does) and at
    least ``min_tokens`` tokens were generated. Only a window of recent tokens is decoded (the
    longest stop string plus a few tokens), so the cost does not grow with the output length; a
    stop string split by more than that many empty-text tokens would be missed.
    """

    def __init__(self, tokenizer, wave: list[_Slice], counts: torch.Tensor) -> None:
        self.tokenizer = tokenizer
        self.rows: dict[int, SamplingParams] = {}
        slot = 0
        for piece, count in zip(wave, counts.tolist(), strict=True):
            if piece.request.params.stop:
                for offset in range(count):
                    self.rows[slot + offset] = piece.request.params
            slot += count
        longest = max((len(s) for p in self.rows.values() for s in p.stop), default=0)
        self.window = longest + _STOP_WINDOW_SLACK
        self.matched: dict[int, str] = {}

    def check(self, tokens_out, slots: torch.Tensor, skip: torch.Tensor, step: int):
        """Bool ``[rows]``: which rows (not in ``skip``) just completed a stop string."""
        hit = torch.zeros_like(skip)
        if not self.rows:
            return hit
        slot_list, skip_list = slots.tolist(), skip.tolist()
        candidates = [
            (row, slot)
            for row, slot in enumerate(slot_list)
            if slot in self.rows and not skip_list[row] and step + 1 >= self.rows[slot].min_tokens
        ]
        if not candidates:
            return hit
        start = max(0, step + 1 - self.window)
        index = torch.tensor([slot for _, slot in candidates], device=tokens_out.device)
        tails = tokens_out[index, start : step + 1].tolist()
        for (row, slot), tail in zip(candidates, tails, strict=True):
            params = self.rows[slot]
            skip_special = params.skip_special_tokens
            text, before = (
                self.tokenizer.decode(
                    ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
                )
                for ids in (tail, tail[:-1])
            )
            for stop in params.stop:
                if _find_new(stop, text, before) >= 0:
                    hit[row] = True
                    self.matched[slot] = stop
                    break
        return hit


def _find_new(stop: str, text: str, before: str) -> int:
    """Where ``stop`` occurs in ``text`` ending within its newest token (``before`` is the text
    without that token), as vLLM matches stop strings; -1 if it does not."""
    return text.find(stop, max(0, len(before) - len(stop) + 1))
