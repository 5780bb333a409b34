"""The sampler's engine core: one loop that owns the running sequences and the KV cache slots.

Continuous batching, in the shape of vLLM v1's split between a scheduler and a model runner, but
small. Callers never run the model themselves: :meth:`SamplerCore.submit` puts a validated call on
a thread-safe queue and returns a :class:`GenerateFuture`; one core thread repeats a *step*:

1. **leave on cancel**: sequences of a call whose cancel token is set (the caller's
   :mod:`~arctic_platform.engine.cancellation` scope, captured at submit) leave, and the call
   fails with :class:`~arctic_platform.engine.cancellation.OpCancelled`; the others go on;
2. **join**: queued calls are admitted in arrival order while the batch (``max_batch_size`` rows)
   and the KV budget (``max_kv_cache_bytes``) have room; each distinct prompt is prefilled once
   and its keys/values written into the rows of its samples (:mod:`.kv_cache`). So a request that
   arrives while others decode starts at the next step instead of waiting for them to end;
3. **sample** one token for every running row (:mod:`.sampling_ops`; each row's random numbers
   depend only on its seed, sample index and own step, never on what else is batched);
4. **leave when finished**: finished sequences give their rows back (the KV memory is reused by
   the next join), and a call whose last sequence finished gets its outputs;
5. **decode**: one batched forward over the rows still running, each at its own position.

The thread starts with the first call and exits after :data:`IDLE_EXIT_S` without work, so an
engine nobody closes holds no thread. Calls' futures are resolved only at the end of a step, so
once every submitted call is done the core touches neither the model nor the cache: that is what
lets the engine run weight loads, sleep and wake between calls (``SamplingEngine``'s gate).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from arctic_platform.engine import cancellation
from arctic_platform.engine.kv_cache import KVCache
from arctic_platform.engine.sampling_ops import choose_tokens, sequence_keys, step_uniforms
from arctic_platform.engine.sampling_requests import SampleRequest

# How long an idle core thread waits for work before it exits (the next submit starts another).
IDLE_EXIT_S = 2.0
# Tokens decoded around the newest one when looking for stop strings, beyond the string's length.
STOP_WINDOW_SLACK = 8


class GenerateFuture(Future):
    """A call's outputs (one dict per prompt and sample, in order), and when it ran: the core's
    step counter when its first sequence joined (``first_step``) and when it finished
    (``last_step``), and how many decode steps its sequences have taken (``steps_run``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.steps_run = 0


@dataclass(eq=False)
class Call:
    """One ``generate`` call: its requests, the slots of its outputs, and who may cancel it."""

    requests: list[SampleRequest]
    cancel_tokens: tuple[cancellation.CancelToken, ...]
    future: GenerateFuture = field(default_factory=GenerateFuture)
    outputs: list[dict | None] = field(init=False)
    offsets: list[int] = field(init=False)
    remaining: int = field(init=False)
    # (request, first sample, count) not yet admitted; a request whose n does not fit the
    # batch at once joins in parts.
    pending: collections.deque = field(init=False)

    def __post_init__(self) -> None:
        self.offsets, total = [], 0
        for request in self.requests:
            self.offsets.append(total)
            total += request.params.n
        self.outputs = [None] * total
        self.remaining = total
        self.pending = collections.deque((r, 0, r.params.n) for r in self.requests)


@dataclass(eq=False)
class Sequence:
    """One running sample: its tokens so far, and what the outputs need when it finishes."""

    call: Call
    request: SampleRequest
    sample: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, int, list]] = field(default_factory=list)
    reason: int = 0
    stop_string: str | None = None


# Why a sequence finished (the output's finish_reason and stop_reason derive from it).
STOP_ID, STOP_STR, LENGTH = 1, 2, 3


class SamplerCore:
    """The running set, the request queue and the loop (module doc). ``engine`` is the
    :class:`~arctic_platform.engine.sampler.SamplingEngine` whose model and settings it uses."""

    def __init__(self, engine, cache: KVCache) -> None:
        self.engine = engine
        self.cache = cache
        self.steps = 0  # decode steps run since the engine started
        # Called on the core thread after every step (observability, and tests that act at a
        # precise point of a decode).
        self.after_step: list[Callable[[], None]] = []
        self._cond = threading.Condition()
        self._queue: collections.deque[Call] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._rows: list[Sequence] = []
        self._state: dict[str, torch.Tensor] = {}
        self._logits: torch.Tensor | None = None
        self._joining: list[Call] = []  # admitted, being prefilled: not in the rows yet

    # -- the caller's side ------------------------------------------------------------------------

    def submit(self, requests: list[SampleRequest]) -> GenerateFuture:
        """Queue a validated call (seeds assigned); its future resolves to the outputs."""
        call = Call(requests, cancellation.current_tokens())
        with self._cond:
            if self._closed:
                raise RuntimeError("the sampler is closed")
            self._queue.append(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sampler-core", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return call.future

    def close(self) -> None:
        """Stop the loop; calls still queued or running fail with ``OpCancelled``."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def stats(self) -> dict:
        """The running set and the KV memory, for metrics and tests (read on any thread)."""
        with self._cond:
            queued = len(self._queue)
        return {
            "running_sequences": self.cache.active,
            "queued_calls": queued,
            "kv_cache_bytes": self.cache.nbytes,
            "kv_cache_bytes_in_use": self.cache.bytes_in_use,
            "steps": self.steps,
        }

    # -- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._rows and not self._queue and not self._closed:
                    self._cond.wait(IDLE_EXIT_S)
                if self._closed or (not self._rows and not self._queue):
                    self._thread = None
                    closed, queued = self._closed, list(self._queue)
                    self._queue.clear()
                    break
            done: list[tuple[Call, BaseException | None]] = []
            try:
                with torch.inference_mode():
                    self._step(done)
            except Exception as exc:  # the model failed: fail every call it held, keep serving
                done.extend((c, exc) for c in self._drop_everything())
            for call, error in done:
                _settle(call, error)
            for callback in self.after_step:
                callback()
        if closed:
            for call in [*queued, *{id(s.call): s.call for s in self._rows}.values()]:
                # Stopped, as a cancel stops it: the job's release closes its engine.
                reason = cancellation.reason_of(call.cancel_tokens) or "the sampler was closed"
                _settle(call, cancellation.OpCancelled(reason))
            self._rows = []

    def _step(self, done: list) -> None:
        self._leave_cancelled(done)
        self._join()
        if not self._rows:
            return
        finished = self._sample(done)
        if finished:
            order = self.cache.remove_rows(finished)
            index = torch.tensor(order, dtype=torch.long, device=self.engine.device)
            self._rows = [self._rows[i] for i in order]
            self._state = {k: v[index] for k, v in self._state.items()}
        if self._rows:
            self._logits = self.engine.decode(self.cache, self._state["last"])
            self.cache.advance()
            self._state["step"] += 1
            self.steps += 1
            for call in {id(s.call): s.call for s in self._rows}.values():
                call.future.steps_run += 1

    def _leave_cancelled(self, done: list) -> None:
        with self._cond:
            gone = [c for c in self._queue if cancellation.reason_of(c.cancel_tokens)]
            for call in gone:
                self._queue.remove(call)
        calls = {id(s.call): s.call for s in self._rows}
        gone += [c for c in calls.values() if cancellation.reason_of(c.cancel_tokens)]
        if not gone:
            return
        ids = {id(c) for c in gone}
        rows = [i for i, s in enumerate(self._rows) if id(s.call) in ids]
        if rows:
            order = self.cache.remove_rows(rows)
            index = torch.tensor(order, dtype=torch.long, device=self.engine.device)
            self._rows = [self._rows[i] for i in order]
            self._state = {k: v[index] for k, v in self._state.items()}
            self._logits = self._logits[index]
        for call in gone:
            done.append(
                (call, cancellation.OpCancelled(cancellation.reason_of(call.cancel_tokens)))
            )

    def _join(self) -> None:
        """Admit queued calls (arrival order) while rows and KV budget allow; prefill them."""
        config, cache = self.engine.config, self.cache
        rows = len(self._rows)
        joining: list[tuple[Call, SampleRequest, int, int]] = []
        with self._cond:
            while self._queue:
                call = self._queue[0]
                request, first, count = call.pending[0]
                positions = len(request.token_ids) + request.max_new
                fit = config.max_batch_size - rows
                while fit > 0 and not cache.fits(rows + fit, positions, config.max_kv_cache_bytes):
                    fit -= 1
                if fit <= 0:
                    break
                take = min(fit, count)
                joining.append((call, request, first, take))
                cache.ensure(
                    rows + take, positions, config.max_kv_cache_bytes, config.max_batch_size
                )
                rows += take
                if take < count:
                    call.pending[0] = (request, first + take, count - take)
                    break
                call.pending.popleft()
                if not call.pending:
                    self._queue.popleft()
        if not joining:
            return
        self._joining = [call for call, _, _, _ in joining]
        logits = self.engine.prefill(cache, [(r.token_ids, n) for _, r, _, n in joining])
        self._joining = []
        state = self._row_state(joining)
        self._state = (
            state if not self._rows else {k: _cat(self._state[k], state[k]) for k in state}
        )
        self._logits = (
            logits if self._logits is None or not self._rows else torch.cat([self._logits, logits])
        )
        for call, request, first, count in joining:
            if call.future.first_step is None:
                call.future.first_step = self.steps
            self._rows.extend(Sequence(call, request, first + i) for i in range(count))

    def _row_state(self, joining) -> dict[str, torch.Tensor]:
        """Per-row tensors of the joining sequences (one row per sample)."""
        eos = self.engine.eos_token_ids
        stops, columns = [], collections.defaultdict(list)
        for _, request, first, count in joining:
            p = request.params
            ids = () if p.ignore_eos else tuple(eos)
            ids += tuple(t for t in p.stop_token_ids if t not in ids)
            for sample in range(first, first + count):
                stops.append(ids)
                columns["seed"].append(request.seed)
                columns["sample"].append(sample)
                columns["greedy"].append(p.greedy)
                columns["temperature"].append(p.temperature)
                columns["top_k"].append(p.top_k)
                columns["top_p"].append(p.top_p)
                columns["min_p"].append(p.min_p)
                columns["max_new"].append(request.max_new)
                columns["min_tokens"].append(p.min_tokens)
                columns["logprobs"].append(-1 if p.logprobs is None else p.logprobs)
        width = max(len(s) for s in stops)
        stop_ids = torch.full((len(stops), width), -1, dtype=torch.long)
        for i, ids in enumerate(stops):
            stop_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        longs = ("max_new", "min_tokens", "top_k", "logprobs")
        state = {
            name: torch.tensor(columns[name], dtype=torch.long if name in longs else torch.float32)
            for name in ("temperature", "top_p", "min_p", *longs)
        }
        state["greedy"] = torch.tensor(columns["greedy"], dtype=torch.bool)
        state["keys"] = sequence_keys(
            torch.tensor(columns["seed"], dtype=torch.long),
            torch.tensor(columns["sample"], dtype=torch.long),
        )
        state["stop_ids"] = stop_ids
        state["step"] = torch.zeros(len(stops), dtype=torch.long)
        state["last"] = torch.zeros(len(stops), dtype=torch.long)
        return {k: v.to(self.engine.device) for k, v in state.items()}

    def _sample(self, done: list) -> list[int]:
        """Choose every row's next token; return the rows that finished (their calls' outputs
        filled in, and each call whose last sequence ended added to ``done``)."""
        state, engine = self._state, self.engine
        step = state["step"]
        tokens, scaled = choose_tokens(
            self._logits,
            greedy=state["greedy"],
            temperature=state["temperature"],
            top_k=state["top_k"],
            top_p=state["top_p"],
            min_p=state["min_p"],
            uniforms=step_uniforms(state["keys"], step),
            suppress=engine.suppression(state["stop_ids"], step < state["min_tokens"]),
        )
        state["last"] = tokens
        self._record_logprobs(tokens, scaled)
        hit_id = (tokens[:, None] == state["stop_ids"]).any(dim=1)
        hit_len = step + 1 >= state["max_new"]
        ended = (hit_id | hit_len).tolist()
        hit_id = hit_id.tolist()
        finished = []
        for row, (seq, token) in enumerate(zip(self._rows, tokens.tolist(), strict=True)):
            seq.tokens.append(token)
            if hit_id[row]:
                seq.reason = STOP_ID
            elif seq.request.params.stop and self._stop_string(seq):
                seq.reason = STOP_STR
            elif ended[row]:
                seq.reason = LENGTH
            else:
                continue
            finished.append(row)
            call = seq.call
            call.outputs[call.offsets[seq.request.index] + seq.sample] = engine.output(seq)
            call.remaining -= 1
            if call.remaining == 0:
                call.future.last_step = self.steps
                done.append((call, None))
        return finished

    def _record_logprobs(self, tokens: torch.Tensor, scaled: torch.Tensor) -> None:
        wanted = self._state["logprobs"]
        rows = (wanted >= 0).nonzero().squeeze(1)
        if not len(rows):
            return
        log_probs = torch.log_softmax(scaled[rows], dim=-1)
        chosen = log_probs.gather(1, tokens[rows, None])
        rank = (log_probs > chosen).sum(1) + 1  # vLLM's 1-based rank
        k = int(wanted[rows].max())
        top = log_probs.topk(k, dim=-1) if k else None
        top_ids = top.indices.tolist() if top is not None else None
        top_values = top.values.tolist() if top is not None else None
        columns = (rows.tolist(), chosen.squeeze(1).tolist(), rank.tolist(), wanted[rows].tolist())
        for i, (row, value, r, want) in enumerate(zip(*columns, strict=True)):
            pairs = (
                [[t, v] for t, v in zip(top_ids[i][:want], top_values[i][:want], strict=True)]
                if want
                else []
            )
            self._rows[row].logprobs.append((value, r, pairs))

    def _stop_string(self, seq: Sequence) -> bool:
        """Whether the newest token completed one of the sequence's stop strings (as vLLM: an
        occurrence ending in the newest token's text, once ``min_tokens`` were generated). Only
        a window of recent tokens is decoded, so the cost does not grow with the output."""
        params = seq.request.params
        if len(seq.tokens) < params.min_tokens:
            return False
        window = max(len(s) for s in params.stop) + STOP_WINDOW_SLACK
        tail = seq.tokens[-window:]
        decode = self.engine.tokenizer.decode
        options = {"skip_special_tokens": params.skip_special_tokens}
        text = decode(tail, clean_up_tokenization_spaces=False, **options)
        before = decode(tail[:-1], clean_up_tokenization_spaces=False, **options)
        for stop in params.stop:
            if find_new(stop, text, before) >= 0:
                seq.stop_string = stop
                return True
        return False

    def _drop_everything(self) -> list[Call]:
        """After a failed step: every call the core had started (running or being prefilled)
        leaves, including its parts still queued; the cache is empty again."""
        calls = {id(c): c for c in [*(s.call for s in self._rows), *self._joining]}
        with self._cond:
            for call in calls.values():
                if call in self._queue:
                    self._queue.remove(call)
        self.cache.remove_rows(list(range(self.cache.active)))
        self._rows, self._state, self._logits, self._joining = [], {}, None, []
        return list(calls.values())


def find_new(stop: str, text: str, before: str) -> int:
    """Where ``stop`` occurs in ``text`` ending within its newest token (``before`` is the text
    without that token), as vLLM matches stop strings; -1 if it does not."""
    return text.find(stop, max(0, len(before) - len(stop) + 1))


def _cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows of ``a`` then ``b``; 2-D columns (stop ids) padded with -1 to the wider one."""
    if a.ndim == 2 and a.shape[1] != b.shape[1]:
        width = max(a.shape[1], b.shape[1])
        a = torch.nn.functional.pad(a, (0, width - a.shape[1]), value=-1)
        b = torch.nn.functional.pad(b, (0, width - b.shape[1]), value=-1)
    return torch.cat([a, b])


def _settle(call: Call, error: BaseException | None) -> None:
    if call.future.done():
        return
    if error is None:
        call.future.set_result(call.outputs)
    else:
        call.future.set_exception(error)
