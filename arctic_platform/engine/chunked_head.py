"""The LM head in chunks: token log-probs, entropies and top-k without the whole logits.

At a real vocabulary the logits dominate a step's memory: a microbatch of 3,072 tokens over
Qwen3's 151,936 tokens is 1.9 GB of float32 logits, and autograd keeps several tensors that size
for backward. Here the model runs with its output layer bypassed (the call returns that layer's
input, the final hidden states, :meth:`LMHead.bypassed`), and the head is applied to ``chunk``
token rows at a time (:class:`ChunkedLogits`): forward keeps only each row's log-sum-exp (and
entropy); backward (:class:`_ChunkedHeadScores`) recomputes each chunk's logits and sends their
gradient to the hidden states and the head's weight chunk by chunk. The head's peak memory is
about :data:`CHUNK_BUFFERS` ``x chunk x V`` float32 whatever the microbatch, for one extra head
matrix product in backward. Only the positions a microbatch scores go through the head.

The results equal :class:`~arctic_platform.engine.logprobs.DenseLogits`' to float rounding: the
same float32 formulas (log-prob ``logit[target] - logsumexp``, entropy ``lse - sum(p * logit)``,
temperature as a float32 division), per chunk.

**Which models**: the head must be a plain ``torch.nn.Linear`` (PEFT's adapters on the body and
tied embeddings are fine: the layer's weight is used as it is, and its gradient reaches the tied
embedding through autograd), and the model's logits must be exactly that layer applied to its
input, which :meth:`LMHead.of` checks once on a 4-token probe when the engine is built. A model
that soft-caps or scales its logits after the head, or a head wrapped by an adapter, keeps the
whole-logits path (logged). The layer is bypassed by hooks, so the call goes through the model's
own forward and whatever wraps it (DDP, FSDP2, PEFT).

**When**: :class:`~arctic_platform.contract.settings.LogitsSettings` (``optimization: memory``,
the default) chunks a microbatch whose whole logits, with the tensors autograd keeps beside them
(:data:`DENSE_BUFFERS`), would not fit ``peak_mem_size_in_gib``; chunks are as long as that budget
allows (:attr:`LMHead.chunk_rows`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from arctic_platform.contract.settings import LogitsSettings
from arctic_platform.engine.logprobs import DenseLogits, Logits, TokenScores

log = logging.getLogger(__name__)

FLOAT32_BYTES = 4
# [rows, V] float32 tensors the chunked head holds at once: a chunk's logits and one temporary of
# their size (log-sum-exp's shifted copy, the probabilities for the entropy or the log-softmax for
# top-k in forward; the probabilities while the logits' gradient is formed in backward).
CHUNK_BUFFERS = 2
# The same count for whole logits through autograd: the logits kept for backward and, in backward,
# the softmax, the gathered log-prob's scattered gradient and their sum.
DENSE_BUFFERS = 4
# Tokens of the probe that checks a model's logits are its head applied to the head's input.
PROBE_TOKENS = 4


class LMHead:
    """A model's output layer, found and checked once (:meth:`of`), with the memory budget that
    decides when and in what chunks it runs (module doc)."""

    def __init__(self, linear: torch.nn.Linear, budget_bytes: int) -> None:
        self.linear = linear
        self.budget_bytes = budget_bytes

    @classmethod
    def of(cls, model: torch.nn.Module, settings: LogitsSettings) -> LMHead | None:
        """The chunked head of ``model`` (before any data-parallel wrapper), or None when the
        settings ask for whole logits or the model's logits are not its plain head's (logged)."""
        if settings.optimization == "none":
            return None
        linear = model.get_output_embeddings()
        problem = _plain_head_problem(model, linear)
        if problem is not None:
            log.warning("logits.optimization=memory: whole logits for this model (%s)", problem)
            return None
        return cls(linear, settings.peak_bytes)

    @property
    def vocab(self) -> int:
        return int(self.linear.out_features)

    @property
    def chunk_rows(self) -> int:
        """Token rows per chunk: as many as keep :data:`CHUNK_BUFFERS` float32 rows of logits
        within the budget (at least one)."""
        return max(1, self.budget_bytes // (self.vocab * FLOAT32_BYTES * CHUNK_BUFFERS))

    def chunks(self, rows: int) -> bool:
        """Whether scoring ``rows`` positions goes through chunks: when their whole logits and
        what autograd keeps beside them (:data:`DENSE_BUFFERS`) would not fit the budget."""
        return rows * self.vocab * FLOAT32_BYTES * DENSE_BUFFERS > self.budget_bytes

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Model calls in this thread, inside the block, return the head's input (the final
        hidden states) as their ``logits``; the head itself multiplies an empty slice.

        Hooks rather than a substitute layer, so the call runs through the model's own forward
        and its wrappers; calls from other threads are left alone.
        """
        owner = threading.get_ident()
        held: list[torch.Tensor] = []

        def take_input(module, args):
            if threading.get_ident() != owner:
                return None
            held.append(args[0])
            return (args[0].narrow(-2, 0, 0), *args[1:])

        def give_input_back(module, args, output):
            if threading.get_ident() != owner:
                return None
            return held.pop()

        handles = [
            self.linear.register_forward_pre_hook(take_input),
            self.linear.register_forward_hook(give_input_back),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def model_logits(
    model: torch.nn.Module, mb, head: LMHead | None, wanted: torch.Tensor | None = None
) -> Logits:
    """One model call on microbatch ``mb`` (a ``MicroBatch`` or ``SharedMicroBatch``, already on
    the device): chunked when ``head`` says the scored positions need it, else whole logits.

    ``wanted`` (bool, one per entry of ``mb.pred_index``; None: all) narrows the positions a
    chunked head computes; whole logits cover every position.
    """
    if head is not None:
        predicting = mb.pred_index if wanted is None else mb.pred_index[wanted]
        positions = torch.unique(predicting)
        if head.chunks(int(positions.numel())):
            with head.bypassed():
                hidden = mb.model_outputs(model)
            return ChunkedLogits(hidden=hidden, positions=positions, head=head)
    return DenseLogits(mb.model_outputs(model))


@dataclass(frozen=True)
class ChunkedLogits:
    """A model call's logits, never whole: its head's input ``hidden`` (``[r, T, H]``) and the
    flat positions (ascending, into ``r x T``) whose scores are wanted; the others score 0."""

    hidden: torch.Tensor
    positions: torch.Tensor
    head: LMHead
    divisor: float = 1.0

    def divided(self, temperature: float) -> ChunkedLogits:
        return replace(self, divisor=self.divisor * temperature)

    def scores(self, targets: torch.Tensor, *, want_entropy: bool, top_k: int) -> TokenScores:
        rows = self._rows()
        picked = targets.reshape(-1).index_select(0, self.positions).long()
        weight, bias = self.head.linear.weight, self.head.linear.bias
        chunk = self.head.chunk_rows
        inputs = [t for t in (rows, weight, bias) if t is not None]
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            out = _ChunkedHeadScores.apply(
                rows, weight, bias, picked, self.divisor, chunk, want_entropy
            )
            logprobs, entropy = out if want_entropy else (out, None)
            top = self.top(top_k) if top_k else None
        else:
            scan = _scan(rows, weight, bias, picked, self.divisor, chunk, want_entropy, top_k)
            logprobs, entropy = scan.logprobs, scan.entropy
            top = None if scan.top is None else tuple(self._place(t) for t in scan.top)
        return TokenScores(
            self._place(logprobs), None if entropy is None else self._place(entropy), top
        )

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight, bias = self.head.linear.weight, self.head.linear.bias
        with torch.no_grad():
            scan = _scan(
                self._rows(), weight, bias, None, self.divisor, self.head.chunk_rows, False, k
            )
        values, ids = scan.top
        return self._place(values), self._place(ids)

    def _rows(self) -> torch.Tensor:
        """``[n, H]``: the head's input at the scored positions."""
        return self.hidden.reshape(-1, self.hidden.shape[-1]).index_select(0, self.positions)

    def _place(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position ``values`` ``[n, ...]`` -> the model layout ``[r, T, ...]``."""
        r, t = self.hidden.shape[:2]
        out = values.new_zeros((r * t, *values.shape[1:]))
        return out.index_copy(0, self.positions, values).view(r, t, *values.shape[1:])


@dataclass(frozen=True)
class _Scan:
    """What one forward pass over the chunks computed (``[n]`` / ``[n, k]``)."""

    logprobs: torch.Tensor | None
    lse: torch.Tensor
    entropy: torch.Tensor | None
    top: tuple[torch.Tensor, torch.Tensor] | None


def _chunk_logits(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, divisor: float
) -> torch.Tensor:
    """One chunk's float32 logits, divided by the temperature (a fresh tensor: callers work in
    place)."""
    logits = F.linear(rows, weight, bias)
    logits = logits.float() if logits.dtype != torch.float32 else logits
    return logits.div_(divisor) if divisor != 1.0 else logits


def _scan(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor | None,
    divisor: float,
    chunk: int,
    want_entropy: bool,
    top_k: int,
) -> _Scan:
    """The forward pass: each chunk's logits, reduced to per-row quantities, then dropped."""
    n = rows.shape[0]
    f32 = {"dtype": torch.float32, "device": rows.device}
    lse = torch.empty(n, **f32)
    logprobs = None if targets is None else torch.empty(n, **f32)
    entropy = torch.empty(n, **f32) if want_entropy else None
    top = None
    if top_k:
        top = (
            torch.empty(n, top_k, **f32),
            torch.empty(n, top_k, dtype=torch.long, device=rows.device),
        )
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        logits = _chunk_logits(rows[start:end], weight, bias, divisor)
        if entropy is None:
            part = torch.logsumexp(logits, dim=-1)
        else:  # one exponential serves both: lse = m + log(s), H = lse - sum(e * logits) / s
            peak = logits.amax(dim=-1, keepdim=True)
            shifted = torch.sub(logits, peak).exp_()
            total = shifted.sum(-1)
            part = peak.squeeze(-1) + total.log()
            entropy[start:end] = part - shifted.mul_(logits).sum(-1) / total
            del shifted
        lse[start:end] = part
        if logprobs is not None:
            picked = logits.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1)
            logprobs[start:end] = picked - part
        if top is not None:
            values, ids = torch.topk(torch.log_softmax(logits, dim=-1), top_k, dim=-1)
            top[0][start:end], top[1][start:end] = values, ids
        del logits
    return _Scan(logprobs, lse, entropy, top)


class _ChunkedHeadScores(torch.autograd.Function):
    """``(rows [n, H], weight [V, H], bias, targets [n]) -> logprobs [n]`` (and entropy ``[n]``),
    through the head chunk by chunk in forward and backward (module doc)."""

    @staticmethod
    def forward(ctx, rows, weight, bias, targets, divisor, chunk, want_entropy):
        scan = _scan(rows, weight, bias, targets, divisor, chunk, want_entropy, 0)
        ctx.save_for_backward(rows, weight, bias, targets, scan.lse, scan.entropy)
        ctx.divisor, ctx.chunk, ctx.want_entropy = divisor, chunk, want_entropy
        return (scan.logprobs, scan.entropy) if want_entropy else scan.logprobs

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        rows, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_rows, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_rows = torch.empty_like(rows) if need_rows else None
        # Accumulated over chunks in float32 (a bf16 sum of chunk products would round each).
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need_weight
            else None
        )
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        )
        for start in range(0, rows.shape[0], ctx.chunk):
            end = min(rows.shape[0], start + ctx.chunk)
            chunk_rows = rows[start:end]
            g = grad_logprobs[start:end].unsqueeze(-1)
            part = lse[start:end].unsqueeze(-1)
            # d logprob / d logits = onehot - p; d entropy / d logits = -p (log p + H), so with
            # gradients g (log-prob) and e (entropy): -p (e z + g + e (H - lse)) + g onehot.
            grad = _chunk_logits(chunk_rows, weight, bias, ctx.divisor)
            if ctx.want_entropy:
                e = grad_entropy[start:end].unsqueeze(-1)
                probs = torch.sub(grad, part).exp_()
                offset = g + e * (entropy[start:end].unsqueeze(-1) - part)
                grad.mul_(-e).sub_(offset).mul_(probs)
                del probs
            else:
                grad.sub_(part).exp_().mul_(-g)
            grad.scatter_add_(-1, targets[start:end].unsqueeze(-1), g)
            if ctx.divisor != 1.0:
                grad.div_(ctx.divisor)
            grad = grad.to(weight.dtype)
            if grad_rows is not None:
                torch.mm(grad, weight, out=grad_rows[start:end])
            if grad_weight is not None:
                if weight.dtype == torch.float32:
                    grad_weight.addmm_(grad.t(), chunk_rows)
                else:
                    grad_weight.add_(torch.mm(grad.t(), chunk_rows))
            if grad_bias is not None:
                grad_bias.add_(grad.float().sum(0))
            del grad
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_rows, grad_weight, grad_bias, None, None, None, None


def _plain_head_problem(model: torch.nn.Module, linear) -> str | None:
    """Why ``model``'s logits cannot come from ``linear`` in chunks; None when they can (its
    logits on a probe equal ``linear`` applied to the input ``linear`` saw)."""
    if type(linear) is not torch.nn.Linear:
        return f"its output layer is a {type(linear).__name__}, not a plain Linear"
    seen: list[torch.Tensor] = []
    handle = linear.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    was_training = model.training
    model.eval()  # no dropout: the probe draws no random numbers
    try:
        count = min(PROBE_TOKENS, linear.out_features)
        ids = torch.arange(count, device=linear.weight.device).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
            if len(seen) != 1:
                return "its output layer ran more than once per call"
            expected = F.linear(seen[0], linear.weight, linear.bias)
    finally:
        handle.remove()
        model.train(was_training)
    if logits.shape != expected.shape or not torch.equal(logits.float(), expected.float()):
        return "its logits are not its output layer's output (soft-capped or scaled)"
    return None
