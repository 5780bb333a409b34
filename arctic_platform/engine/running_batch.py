"""The sampler's running batch: the sequences decoding now, their KV cache and their outputs.

Sequences join between decode steps and leave when they finish, so a request that arrives while
others decode does not wait for them (continuous batching). :mod:`.decode_loop` decides what
joins and when; this module holds the batch and runs its steps:

* :meth:`RunningBatch.plan` — which waiting samples fit now, in arrival order: at most
  ``max_batch_size`` rows whose cache fits ``max_kv_cache_bytes`` (each prompt's keys once, each
  row's completion: :class:`~arctic_platform.engine.kv_cache.Geometry`). A request's ``n``
  samples may join in parts; a later part finds its prompt in the prompt cache (unless it is off
  or the prompt was evicted).
* :meth:`RunningBatch.admit` — each distinct prompt of the joining samples (whichever requests
  they came from) takes one group of the prefix store, which all its samples' rows read
  (:mod:`~arctic_platform.engine.shared_prefix`): copied from the prompt cache
  (:mod:`~arctic_platform.engine.prompt_cache`) when an earlier admission prefilled it on these
  weights, else prefilled **once** (left-padded to the widest of them, in microbatches of at most
  ``max_tokens_per_microbatch`` padded tokens) and then cached. When the cache holds a prompt
  that starts like it, the keys and values of that start are copied and only the rest is
  prefilled, attending to them (those prompts' prefills come after the others'). Rows share
  one suffix write column: the running rows keep their completions but drop the columns none of
  them uses, and the newcomers start left-padded at the write column
  (:meth:`~arctic_platform.engine.kv_cache.KVCache.relayout`); position ids are per row.
* :meth:`RunningBatch.sample` — one token for every row (each row at its own step, so its random
  numbers depend only on its seed, its sample index and its step: a seeded request gets the
  same samples alone or joining any batch), stop checks, and the outputs of the rows that just
  finished. A finished row keeps its place until an eighth of the rows are finished; then the
  cache and all row state are compacted, so the work per step tracks the live sequences
  without paying a compaction for every single finish.
* :meth:`RunningBatch.advance` — one batched forward over the rows, feeding the tokens sampled.

Only one thread at a time may call these (the loop's driver).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from arctic_platform.contract.sampling_params import SamplingParams
from arctic_platform.engine.config import SamplingEngineConfig
from arctic_platform.engine.errors import UnsupportedModel
from arctic_platform.engine.kv_cache import Geometry, KVBufferPool, KVCache
from arctic_platform.engine.prompt_cache import CachedPrompt, PromptCache
from arctic_platform.engine.sampling_ops import choose_tokens, sequence_keys, step_uniforms
from arctic_platform.engine.sampling_requests import SampleRequest
from arctic_platform.engine.shared_prefix import SharedPrefixStep, layout
from arctic_platform.engine.stop_strings import stop_string_hits

STOP_ID, STOP_STR, LENGTH = 1, 2, 3


@dataclass
class Slice:
    """Samples ``first .. first + count - 1`` of ``request``, asked for by ``owner``."""

    owner: Any
    request: SampleRequest
    first: int
    count: int


@dataclass
class Finished:
    """A sequence that left the batch, as raw values (its caller shapes the output)."""

    owner: Any
    request: SampleRequest
    sample: int
    token_ids: list[int]
    reason: int  # STOP_ID, STOP_STR or LENGTH
    stop_string: str | None
    logprobs: list[float] | None  # of the sampled tokens, when the request asked for log-probs
    ranks: list[int] | None
    top: list[list[list]] | None  # per token, ``[[token_id, logprob], ...]`` of the k likeliest
    cached_tokens: int = 0  # of its prompt's tokens, how many the prompt cache provided


@dataclass
class _Row:
    owner: Any
    request: SampleRequest
    sample: int
    stops: SamplingParams | None  # the params, when the request has stop strings
    continues: bool  # its prompt extends a whole cached one: a multi-turn rollout's next turn
    cached_tokens: int  # of its prompt's tokens, how many the prompt cache provided


@dataclass(frozen=True)
class ModelSide:
    """What the batch needs of the engine's model."""

    model: Any
    device: torch.device
    vocab_size: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    kv_bytes_per_token: int
    tokenizer: Any


class RunningBatch:
    """The rows decoding together (see the module doc)."""

    def __init__(
        self,
        side: ModelSide,
        config: SamplingEngineConfig,
        pool: KVBufferPool,
        prompt_cache: PromptCache,
    ) -> None:
        self.side = side
        self.config = config
        self.pool = pool
        self.prompt_cache = prompt_cache
        self.joins = 0  # admissions into a batch that had rows running: continuous batching
        self.clear()

    def clear(self) -> None:
        """Forget every row (the cache buffers stay in the pool)."""
        self._rows: list[_Row] = []
        self._state: dict[str, torch.Tensor] = {}
        self._out: dict[str, torch.Tensor] = {}
        self._cache: KVCache | None = None
        self._logits: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None
        self._step: SharedPrefixStep | None = None
        # each prefix group's prompt length (prompts are right-aligned in the prefix store)
        self._group_len = torch.zeros(0, dtype=torch.long, device=self.side.device)
        self._length = 0  # the next suffix column every row writes

    @property
    def empty(self) -> bool:
        return not self._rows

    @property
    def live(self) -> int:
        return 0 if self.empty else int((~self._state["done"]).sum())

    # ------------------------------------------------------------------------------------------
    # joining

    def _live_extent(self) -> _Extent:
        """What the live rows occupy (see :class:`_Extent`)."""
        none = torch.zeros(0, dtype=torch.long, device=self.side.device)
        if self.empty:
            return _Extent(none, 0, 0, 0, none, 0)
        state = self._state
        keep = (~state["done"]).nonzero().squeeze(1)
        if len(keep) == 0:
            return _Extent(keep, 0, 0, 0, none, 0)
        trim = int(state["suffix_start"][keep].min())
        left = int((state["max_new"] - state["gen"])[keep].max())
        groups = state["group"][keep].unique()
        prompt = int(self._group_len[groups].max())
        return _Extent(keep, trim, self._length - trim, left, groups, prompt)

    def plan(self, waiting: Iterable[Slice]) -> list[Slice]:
        """The longest prefix of ``waiting`` (its last slice maybe in part) that fits now."""
        per_token = self.side.kv_bytes_per_token
        live = self._live_extent()
        rows, groups, prompt, left = len(live.rows), len(live.groups), live.prompt, live.left
        chosen: list[Slice] = []
        seen: set[tuple[int, ...]] = set()  # prompts already given a group (one per prompt)
        for piece in waiting:
            key = tuple(piece.request.token_ids)
            new_group = int(key not in seen)
            p = max(prompt, len(key))
            m = max(left, piece.request.max_new)
            # maybe one more prefix group, all of p columns; each row a completion of width + m
            taken = Geometry(groups + new_group, p, rows, live.width + m).nbytes(per_token)
            by_memory = (self.config.max_kv_cache_bytes - taken) // ((live.width + m) * per_token)
            room = min(self.config.max_batch_size - rows, by_memory)
            if room <= 0:
                break
            count = min(room, piece.count)
            chosen.append(Slice(piece.owner, piece.request, piece.first, count))
            rows, groups, prompt, left = rows + count, groups + new_group, p, m
            seen.add(key)
            if count < piece.count:
                break
        return chosen

    def admit(self, slices: list[Slice]) -> None:
        """Prefill ``slices`` (from :meth:`plan`) into new rows; they sample at the next step."""
        live = self._live_extent()
        if len(live.rows):
            self.joins += 1
        prompts, matches, slices, slice_group = self._distinct_prompts(slices)
        counts = torch.tensor([s.count for s in slices])
        width = max(live.prompt, *(len(p) for p in prompts))
        geometry = Geometry(
            groups=len(live.groups) + len(prompts),
            prefix_width=width,
            rows=len(live.rows) + int(counts.sum()),
            capacity=live.width + max(live.left, *(s.request.max_new for s in slices)),
        )
        if self._cache is None:
            self._cache = KVCache(self.side.num_layers, geometry, self.pool)
        self._leave_room(geometry)  # before the stores grow, so the two never exceed the budget
        self._cache.relayout(
            geometry,
            rows=(live.rows, live.trim, self._length, live.width),
            groups=(live.groups, live.prompt),
        )
        state = {k: v[live.rows] for k, v in self._state.items()}
        if state:
            state["suffix_start"] -= live.trim
            state["group"] = torch.searchsorted(live.groups, state["group"])
        new = self._new_rows(slices, counts, live.width, len(live.groups) + slice_group)
        self._state = _concat(state, new)
        lengths = torch.tensor([len(p) for p in prompts], device=self.side.device)
        self._group_len = torch.cat([self._group_len[live.groups], lengths])
        extends = [match is not None and match.extends for match in matches]
        cached = [0 if match is None else match.length for match in matches]
        self._rows = [self._rows[i] for i in live.rows.tolist()] + [
            _Row(
                s.owner,
                s.request,
                sample,
                s.request.params if s.request.params.stop else None,
                extends[group],
                cached[group],
            )
            for s, group in zip(slices, slice_group.tolist(), strict=True)
            for sample in range(s.first, s.first + s.count)
        ]
        self._out = self._grown_outputs(live.rows, geometry.rows)
        per_prompt = self._prefill(prompts, matches, len(live.groups), width)
        logits = per_prompt[slice_group.to(self.side.device)]
        logits = logits.repeat_interleave(counts.to(self.side.device), dim=0)
        old = self._logits[live.rows] if self._logits is not None else logits[:0]
        self._logits = torch.cat([old, logits])
        self._length = live.width
        self._cache.start_decoding(live.width)
        self._update_layout()

    def _distinct_prompts(self, slices: list[Slice]):
        """The admission's distinct prompts (each becomes one prefix group, read by every sample
        of every slice that asked for it: SkyRL sends a prompt ``n`` times as ``n`` requests),
        the prompt cache's match for each (or None), the slices regrouped so each prompt's
        samples sit together, and each slice's prompt index. Prompts to prefill whole come
        first, then those with a cached prefix, so each kind's groups are consecutive
        (:meth:`_prefill`)."""
        by_prompt: dict[tuple[int, ...], list[Slice]] = {}
        for piece in slices:
            by_prompt.setdefault(tuple(piece.request.token_ids), []).append(piece)
        keys = list(by_prompt)
        matches = self.prompt_cache.lookup(keys)
        order = sorted(range(len(keys)), key=lambda i: _prefill_order(matches[i]))
        grouped = [piece for i in order for piece in by_prompt[keys[i]]]
        slice_group = [g for g, i in enumerate(order) for _ in by_prompt[keys[i]]]
        return (
            [keys[i] for i in order],
            [matches[i] for i in order],
            grouped,
            torch.tensor(slice_group, dtype=torch.long),
        )

    def _new_rows(
        self, slices: list[Slice], counts: torch.Tensor, write_at: int, groups: torch.Tensor
    ) -> dict:
        """Per-row tensors of the joining samples (slice ``i`` reads prefix group ``groups[i]``;
        their completions start at suffix column ``write_at``)."""
        per_slice = []
        for piece in slices:
            p, r = piece.request.params, piece.request
            stop_ids = () if p.ignore_eos else tuple(self.side.eos_token_ids)
            stop_ids += tuple(t for t in p.stop_token_ids if t not in stop_ids)
            per_slice.append((p, r, stop_ids))
        width = max((len(s) for _, _, s in per_slice), default=0)
        stop_ids = torch.full((len(slices), width), -1, dtype=torch.long)
        for i, (_, _, ids) in enumerate(per_slice):
            stop_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype).repeat_interleave(counts)

        sample_index = torch.cat([torch.arange(s.first, s.first + s.count) for s in slices])
        seeds = column([r.seed for _, r, _ in per_slice], torch.long)
        prompt = column([len(r.token_ids) for _, r, _ in per_slice], torch.long)
        rows = int(counts.sum())
        state = {
            "position": prompt,
            "group": groups.repeat_interleave(counts),
            "suffix_start": torch.full((rows,), write_at, dtype=torch.long),
            "greedy": column([p.greedy for p, _, _ in per_slice], torch.bool),
            "temperature": column([p.temperature for p, _, _ in per_slice], torch.float32),
            "top_k": column([p.top_k for p, _, _ in per_slice], torch.long),
            "top_p": column([p.top_p for p, _, _ in per_slice], torch.float32),
            "min_p": column([p.min_p for p, _, _ in per_slice], torch.float32),
            "max_new": column([r.max_new for _, r, _ in per_slice], torch.long),
            "min_tokens": column([p.min_tokens for p, _, _ in per_slice], torch.long),
            "keys": sequence_keys(seeds, sample_index),
            "stop_ids": stop_ids.repeat_interleave(counts, dim=0),
            "gen": torch.zeros(rows, dtype=torch.long),
            "done": torch.zeros(rows, dtype=torch.bool),
            "reason": torch.zeros(rows, dtype=torch.int8),
        }
        return {k: v.to(self.side.device) for k, v in state.items()}

    def _grown_outputs(self, keep: torch.Tensor, rows: int) -> dict[str, torch.Tensor]:
        """Output buffers for ``rows`` rows, the kept rows' tokens so far copied over."""
        params = [row.request.params for row in self._rows]
        longest = max(row.request.max_new for row in self._rows)
        k = max((p.logprobs or 0) for p in params)
        device = self.side.device
        out = {"tokens": torch.zeros(rows, longest, dtype=torch.long, device=device)}
        if any(p.logprobs is not None for p in params):
            out["logprob"] = torch.zeros(rows, longest, device=device)
            out["rank"] = torch.zeros(rows, longest, dtype=torch.long, device=device)
            if k:
                out["top_ids"] = torch.zeros(rows, longest, k, dtype=torch.long, device=device)
                out["top_lp"] = torch.zeros(rows, longest, k, device=device)
        for name, old in self._out.items():
            # A kept row's tokens (and top-k) fit the new widths, but the old buffers may be
            # wider: the row that needed them may have left.
            sizes = [min(a, b) for a, b in zip(old.shape[1:], out[name].shape[1:], strict=True)]
            index = tuple(slice(0, size) for size in sizes)
            out[name][(slice(0, len(keep)), *index)] = old[keep][(slice(None), *index)]
        return out

    def _prefill(
        self, prompts: list[tuple[int, ...]], matches: list, first_group: int, width: int
    ) -> torch.Tensor:
        """Put ``prompts`` into groups ``first_group ..`` of a prefix store ``width`` columns wide:
        a cached one by copying its entry; one whose start is cached by copying that and running
        the model on the rest; the others (first in ``prompts``) by running the model on all of
        it. The prompt cache then keeps each prompt the model ran on. Returns each prompt's
        first-step logits ``[prompts, vocab]`` (float32)."""
        side = self.side
        logits = torch.empty(len(prompts), side.vocab_size, device=side.device)
        runs: list[list[tuple[int, tuple[int, ...], int]]] = [[], []]  # whole, rest of a prefix
        for i, (prompt, match) in enumerate(zip(prompts, matches, strict=True)):
            if match is None:
                runs[0].append((i, prompt, 0))
                continue
            # before any prefill: it may initialise the stores
            before = len(prompt) - match.length
            self._cache.write_prefix(first_group + i, match.entry.layers, match.length, before)
            if match.complete:
                logits[i] = match.entry.logits
            else:
                runs[1].append((i, prompt, match.length))
            matches[i] = None  # the prefix store holds it now: an evicted entry can go
        for pieces in runs:
            if not pieces:
                continue
            # One width for every microbatch of a run: a prompt prefilled whole writes every
            # column of the run's widest, so no column it may read is left as the buffer held it.
            # A microbatch holds at most max_tokens_per_microbatch input tokens; with a cached
            # start its attention reads span columns a row, as a whole prompt of span tokens
            # would, so its scores are no larger than those of prompts that long prefilled whole.
            inputs = max(len(prompt) - reused for _, prompt, reused in pieces)
            span = max(len(prompt) for _, prompt, _ in pieces)  # the columns attention reads
            per_batch = max(1, self.config.max_tokens_per_microbatch // inputs)
            for start in range(0, len(pieces), per_batch):
                batch = pieces[start : start + per_batch]
                first = batch[0][0]
                logits[first : first + len(batch)] = self._forward(
                    batch, first_group + first, width, inputs, span
                )
        ran = [piece for pieces in runs for piece in pieces]
        if ran and self.prompt_cache.enabled:
            self._leave_room(self._cache.geometry)  # the stores now hold their buffers
            self.prompt_cache.store(
                (prompt, self._cached(first_group + i, len(prompt), logits[i]))
                for i, prompt, _ in ran
                if self._entry_fits(len(prompt))
            )
        return logits

    def _forward(
        self,
        pieces: list[tuple[int, tuple[int, ...], int]],
        first: int,
        width: int,
        inputs: int,
        span: int,
    ) -> torch.Tensor:
        """One prefill forward of ``pieces`` ``(index, prompt, reused)`` into groups ``first ..``
        (right-aligned at ``width``), ``inputs`` tokens wide, attending over ``span`` columns:
        each prompt's tokens after its first ``reused`` ones, which its group holds already (all
        rows reuse some, or none does). Returns each one's last-token logits."""
        side = self.side
        ids = torch.full((len(pieces), inputs), side.pad_token_id, dtype=torch.long)
        attention = torch.zeros(len(pieces), span, dtype=torch.bool)
        positions = torch.zeros(len(pieces), inputs, dtype=torch.long)
        written = torch.zeros(len(pieces), inputs, dtype=torch.bool)
        for row, (_, prompt, reused) in enumerate(pieces):
            new = len(prompt) - reused
            ids[row, inputs - new :] = torch.tensor(prompt[reused:])
            attention[row, span - len(prompt) :] = True
            positions[row, inputs - new :] = torch.arange(reused, len(prompt))
            written[row, inputs - new :] = True
        past = span - inputs
        with self._cache.prefill_groups(
            first, width - inputs, past, written.to(side.device) if past else None
        ):
            out = side.model(
                input_ids=ids.to(side.device),
                attention_mask=attention.to(side.device),
                position_ids=positions.to(side.device),
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[:, -1].float()

    def _leave_room(self, geometry: Geometry) -> None:
        """The prompt cache keeps only what the batch's cache leaves of ``max_kv_cache_bytes``:
        the pool's buffers (kept at their largest, for reuse), or
        ``geometry``'s bytes where they will be larger."""
        used = max(self.pool.nbytes, geometry.nbytes(self.side.kv_bytes_per_token))
        self.prompt_cache.make_room(self.config.max_kv_cache_bytes - used)

    def _entry_fits(self, tokens: int) -> bool:
        """Whether the prompt cache could keep an entry of ``tokens`` tokens (asked before any
        copy is made)."""
        logit_bytes = self.side.vocab_size * torch.float32.itemsize  # CachedPrompt's logits
        return self.prompt_cache.fits(tokens * self.side.kv_bytes_per_token + logit_bytes)

    def _cached(
        self,
        group: int,
        length: int,
        logits: torch.Tensor,
        tail: tuple[int, int, int] | None = None,
    ) -> CachedPrompt:
        """Copies of ``group``'s prompt of ``length`` tokens (and, with ``tail``, a row's suffix
        columns after it: :meth:`KVCache.read_prefix`) and of ``logits``, for the prompt
        cache."""
        return CachedPrompt(self._cache.read_prefix(group, length, tail), logits.clone())

    def _update_layout(self) -> None:
        """The decode steps' :class:`SharedPrefixStep` for the rows and groups now."""
        state, geometry = self._state, self._cache.geometry
        self._step = layout(
            state["group"],
            geometry.groups,
            self._cache.prefix,
            prefix_bias=_bias(
                geometry.prefix_width - self._group_len[state["group"]], geometry.prefix_width
            ),
            suffix_bias=_bias(state["suffix_start"], geometry.capacity),
        )

    # ------------------------------------------------------------------------------------------
    # stepping

    def drop(self, owner: Any) -> None:
        """End ``owner``'s rows without outputs (its caller stopped)."""
        if self.empty:
            return
        mine = [i for i, row in enumerate(self._rows) if row.owner is owner]
        if mine:
            self._state["done"][torch.tensor(mine, device=self.side.device)] = True
            self._compact()

    def sample(self) -> list[Finished]:
        """Choose every live row's next token; return the rows that finished with it."""
        state, out = self._state, self._out
        live = ~state["done"]
        gen = state["gen"]
        tokens, scaled = choose_tokens(
            self._logits,
            greedy=state["greedy"],
            temperature=state["temperature"],
            top_k=state["top_k"],
            top_p=state["top_p"],
            min_p=state["min_p"],
            uniforms=step_uniforms(state["keys"], gen),
            suppress=self._suppression(),
        )
        # Finished rows (until compacted) write into a column of theirs that was already read out.
        rows = torch.arange(len(gen), device=gen.device)
        column = gen.clamp(max=out["tokens"].shape[1] - 1)
        out["tokens"][rows, column] = tokens
        if "logprob" in out:
            log_probs = torch.log_softmax(scaled, dim=-1)
            chosen = log_probs.gather(1, tokens[:, None])
            out["logprob"][rows, column] = chosen.squeeze(1)
            out["rank"][rows, column] = (log_probs > chosen).sum(1) + 1  # vLLM's 1-based rank
            if "top_ids" in out:
                values, ids = log_probs.topk(out["top_ids"].shape[2], dim=-1)
                out["top_ids"][rows, column] = ids
                out["top_lp"][rows, column] = values
        hit_id = (tokens[:, None] == state["stop_ids"]).any(dim=1) & live
        candidates = live & ~hit_id & (gen + 1 >= state["min_tokens"])
        params = [row.stops for row in self._rows]
        hit_str, matched = stop_string_hits(
            self.side.tokenizer, params, out["tokens"], column, candidates
        )
        hit_len = (gen + 1 >= state["max_new"]) & live & ~hit_id & ~hit_str
        finished = hit_id | hit_str | hit_len
        state["reason"] = torch.where(
            hit_id,
            STOP_ID,
            torch.where(hit_str, STOP_STR, torch.where(hit_len, LENGTH, state["reason"])),
        ).to(torch.int8)
        state["gen"] = gen + live.long()
        state["done"] |= finished
        self._tokens = tokens
        ended = finished.nonzero().squeeze(1)
        results = self._read_out(ended, matched) if len(ended) else []
        continuing = any(self._rows[row].continues for row in ended.tolist())
        if continuing and self.prompt_cache.enabled:
            self.prompt_cache.store(self._finished_sequences(ended, results))
        self._compact()
        return results

    def _finished_sequences(self, ended: torch.Tensor, results: list[Finished]):
        """For the prompt cache, each sequence that just finished on a prompt that continued a
        cached one, as the start of its next turn (a multi-turn rollout sends its prompt and
        completion back, with an observation): its prompt and the completion tokens fed so far
        (all but the last sampled), with the logits the last token was sampled from; one too
        large for the cache is not copied. Single-turn work (a GRPO step's new prompts, an
        evaluation's repeated ones) continues nothing, so it pays no copy."""
        state = self._state
        starts = state["suffix_start"][ended].tolist()
        groups = state["group"][ended].tolist()
        for row, start, group, done in zip(ended.tolist(), starts, groups, results, strict=True):
            if not self._rows[row].continues:
                continue
            fed = len(done.token_ids) - 1
            prompt = done.request.token_ids
            key = (*prompt, *done.token_ids[:fed])
            if fed > 0 and self._entry_fits(len(key)):
                tail = (row, start, fed)
                yield key, self._cached(group, len(prompt), self._logits[row], tail)

    def advance(self) -> None:
        """One forward over the rows: the tokens sampled last go into the cache."""
        if self.empty:
            return
        state, step = self._state, self._step
        step.layers_seen = 0
        try:
            out = self.side.model(
                input_ids=self._tokens[:, None],
                position_ids=state["position"][:, None],
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=1,
                shared_prefix=step,
            )
        except TypeError as exc:  # a forward without **kwargs somewhere on the way
            if "shared_prefix" in str(exc):
                raise self._unsupported(0) from exc
            raise
        if step.layers_seen != self.side.num_layers:
            raise self._unsupported(step.layers_seen)
        self._logits = out.logits[:, -1].float()
        state["position"] += 1
        self._length += 1

    def _unsupported(self, layers_seen: int) -> UnsupportedModel:
        return UnsupportedModel(
            f"{type(self.side.model).__name__} did not pass the decode step's shared_prefix "
            f"keyword down to its attention ({layers_seen} of {self.side.num_layers} layers "
            "did): the sampler needs a transformers model that forwards attention keywords"
        )

    def _suppression(self) -> torch.Tensor | None:
        """Stop tokens each row may not pick yet (``min_tokens``), as a ``[rows, vocab]`` mask."""
        state = self._state
        stop_ids = state["stop_ids"]
        need = (state["gen"] < state["min_tokens"])[:, None] & (stop_ids >= 0)
        if stop_ids.shape[1] == 0 or not bool(need.any()):
            return None
        vocab = self.side.vocab_size
        index = torch.where(need, stop_ids, vocab)
        mask = torch.zeros(len(stop_ids), vocab + 1, dtype=torch.bool, device=stop_ids.device)
        return mask.scatter_(1, index, True)[:, :vocab]

    def _read_out(self, ended: torch.Tensor, matched: dict[int, str]) -> list[Finished]:
        state, out = self._state, self._out
        counts, reasons = state["gen"][ended].tolist(), state["reason"][ended].tolist()
        host = {name: t[ended].cpu() for name, t in out.items()}
        results = []
        for i, row_index in enumerate(ended.tolist()):
            row, n = self._rows[row_index], counts[i]
            k = row.request.params.logprobs
            wants = k is not None
            results.append(
                Finished(
                    owner=row.owner,
                    request=row.request,
                    sample=row.sample,
                    token_ids=host["tokens"][i, :n].tolist(),
                    reason=reasons[i],
                    stop_string=matched.get(row_index),
                    logprobs=host["logprob"][i, :n].tolist() if wants else None,
                    ranks=host["rank"][i, :n].tolist() if wants else None,
                    top=_top(host, i, n, k) if wants else None,
                    cached_tokens=row.cached_tokens,
                )
            )
        return results

    def _compact(self) -> None:
        """Drop the finished rows once they are an eighth of the batch (or all of it)."""
        done = self._state["done"]
        finished = int(done.sum())
        if finished == len(done):
            self.clear()
            return
        if finished < max(1, len(done) // 8):
            return
        keep = (~done).nonzero().squeeze(1)
        groups = self._state["group"][keep].unique()
        self._group_len = self._group_len[groups]
        self._cache.keep(keep, groups, prefix_width=int(self._group_len.max()))
        self._state = {k: v[keep] for k, v in self._state.items()}
        self._state["group"] = torch.searchsorted(groups, self._state["group"])
        self._out = {k: v[keep] for k, v in self._out.items()}
        self._rows = [self._rows[i] for i in keep.tolist()]
        self._tokens = self._tokens[keep] if self._tokens is not None else None
        self._logits = self._logits[keep] if self._logits is not None else None
        self._update_layout()


@dataclass(frozen=True)
class _Extent:
    """What the live rows of a batch occupy: their ``rows`` (indices), the first suffix column
    any of them uses (``trim``) and the ``width`` from there to the write column, the most new
    tokens any may still need (``left``), the prefix ``groups`` they read and the widest of
    those prompts (``prompt``)."""

    rows: torch.Tensor
    trim: int
    width: int
    left: int
    groups: torch.Tensor
    prompt: int


def _bias(start: torch.Tensor, columns: int) -> torch.Tensor | None:
    """``[rows, 1, 1, columns]``: 0 from each row's ``start`` on, ``-inf`` before; None if no
    row has a masked column."""
    if not bool((start > 0).any()):
        return None
    visible = torch.arange(columns, device=start.device)[None, :] >= start[:, None]
    bias = torch.zeros(visible.shape, device=start.device)
    return bias.masked_fill_(~visible, float("-inf"))[:, None, None, :]


def _prefill_order(match) -> int:
    """Prompts to prefill whole, then those whose start is cached, then cached ones."""
    return 0 if match is None else 2 if match.complete else 1


def _concat(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict:
    """Row state of the kept rows followed by the joining ones (stop-id columns padded)."""
    if not old:
        return new
    width = max(old["stop_ids"].shape[1], new["stop_ids"].shape[1])
    for part in (old, new):
        ids = part["stop_ids"]
        if ids.shape[1] < width:
            pad = ids.new_full((len(ids), width - ids.shape[1]), -1)
            part["stop_ids"] = torch.cat([ids, pad], dim=1)
    return {k: torch.cat([old[k], new[k]]) for k in new}


def _top(host: dict, i: int, n: int, k: int) -> list[list[list]]:
    if not k:
        return [[] for _ in range(n)]
    ids, values = host["top_ids"][i, :n, :k].tolist(), host["top_lp"][i, :n, :k].tolist()
    return [
        [[t, v] for t, v in zip(ids_t, values_t, strict=True)]
        for ids_t, values_t in zip(ids, values, strict=True)
    ]
