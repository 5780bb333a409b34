"""The scoring path shared by every engine: request -> microbatches -> position-indexed outputs.

:func:`prepare_request` validates and plans a whole request before any state changes (so a bad
request leaves the model, optimizer and accumulated gradients untouched). :func:`score` runs one
microbatch through the model and the post-processors and returns ``[b, S]`` tensors in the
position-indexed layout: column ``i`` holds the log-prob of ``input_ids[:, i]`` given the tokens
before it; a sequence's first token and padding hold 0. :func:`forward_no_grad` assembles those
into ``[B, S]`` outputs; the training engine instead back-propagates each microbatch's loss.
With an :class:`~arctic_platform.engine.chunked_head.LMHead` (the engines build one from their
``logits`` settings), a microbatch whose whole logits would not fit its budget is scored through
the head in chunks, forward and backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from arctic_platform.contract.processing import Processing
from arctic_platform.contract.results import loss_fields
from arctic_platform.engine import cancellation
from arctic_platform.engine.batching import Batch, MicroBatch, validate_batch
from arctic_platform.engine.chunked_head import LMHead, model_logits
from arctic_platform.engine.config import PromptSharing, TrainingEngineConfig
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.losses import PreparedLoss, get_loss
from arctic_platform.engine.meta import Meta, parse_request
from arctic_platform.engine.metrics import MetricSums
from arctic_platform.engine.postprocess import ScoringState, run_post_processors
from arctic_platform.engine.prompt_sharing import (
    SAVED_METRIC,
    PromptGroups,
    SharedMicroBatch,
    plan_request,
)


class ModelBounds(Protocol):
    """What validation needs of the model a training request runs on (a training engine, or the
    Ray proxy standing in for its workers): its vocabulary and its context."""

    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class Request:
    """A validated request: the batch, its side information, the bound loss and the plan.

    ``prompt_groups`` are the rows whose prompt the plan computes once (None: no sharing; see
    :mod:`arctic_platform.engine.prompt_sharing`).
    """

    batch: Batch
    meta: Meta
    processing: Processing
    loss: PreparedLoss | None
    plan: list[MicroBatch | SharedMicroBatch]
    want_entropy: bool
    prompt_groups: PromptGroups | None = None

    @property
    def prompt_tokens_saved(self) -> int:
        return 0 if self.prompt_groups is None else self.prompt_groups.saved_tokens

    def sharing_metrics(self) -> dict[str, float]:
        """The prompt-sharing metric pair: tokens not recomputed over the batch's real tokens."""
        return {
            f"{SAVED_METRIC}.sum": float(self.prompt_tokens_saved),
            f"{SAVED_METRIC}.tokens": float(self.batch.attention_mask.sum()),
        }


def prepare_request(
    batch: Mapping,
    meta: Mapping | None,
    processing: Mapping | None,
    *,
    vocab_size: int,
    max_tokens: int,
    packing: bool,
    default_loss: str | None,
    prompt_sharing: PromptSharing = "off",
    max_seq_len: int | None = None,
) -> Request:
    """Validate everything about a request and plan its microbatches; no side effects.

    ``max_seq_len`` is the model's context: a longer row is refused (see
    :func:`~arctic_platform.engine.batching.validate_batch`)."""
    parsed_batch = validate_batch(batch, vocab_size=vocab_size, max_seq_len=max_seq_len)
    parsed_meta, parsed_processing = parse_request(meta, processing, default_loss=default_loss)
    loss = None
    if parsed_processing.loss_fn is not None:
        factory = get_loss(parsed_processing.loss_fn)
        loss = factory(parsed_batch, parsed_meta, parsed_processing.config)
    targets = loss.targets if loss is not None else None
    plan, groups = plan_request(
        parsed_batch,
        parsed_batch.input_ids if targets is None else targets,
        max_tokens=max_tokens,
        packing=packing,
        prompt_sharing=prompt_sharing,
    )
    return Request(
        batch=parsed_batch,
        meta=parsed_meta,
        processing=parsed_processing,
        loss=loss,
        plan=plan,
        want_entropy=bool(parsed_meta.calculate_entropy)
        or (loss is not None and loss.needs_entropy),
        prompt_groups=groups,
    )


def prepare_training_request(
    batch: Mapping,
    meta: Mapping | None,
    processing: Mapping | None,
    config: TrainingEngineConfig,
    *,
    model: ModelBounds,
    backward: bool,
) -> Request:
    """:func:`prepare_request` under a training engine's microbatch budget, packing and prompt
    sharing (off under gradient checkpointing, which turns the key/value cache off).

    For a backward pass (``forward_backward``) the loss defaults by the batch's kind
    (:func:`default_loss_for`) and is required; a forward pass computes a loss only when one is
    named. Every layer that accepts training requests (the engine, a data-parallel rank, the Ray
    proxy) validates them through here, so they accept and reject the same requests.
    """
    request = prepare_request(
        batch,
        meta,
        processing,
        vocab_size=model.vocab_size,
        max_tokens=config.max_tokens_per_microbatch,
        packing=config.packing,
        default_loss=default_loss_for(batch) if backward else None,
        prompt_sharing="off" if config.gradient_checkpointing else config.prompt_sharing,
        max_seq_len=model.max_model_len,
    )
    if backward and request.loss is None:
        raise EngineInputError("processing.loss_fn", "forward_backward needs a loss")
    return request


def default_loss_for(batch: Mapping) -> str:
    """``cross_entropy`` for an SFT batch (labels, no advantages), else ``verl_grpo``."""
    if isinstance(batch, Mapping) and "labels" in batch and "advantages" not in batch:
        return "cross_entropy"
    return "verl_grpo"


def score(
    model: torch.nn.Module,
    mb: MicroBatch | SharedMicroBatch,
    *,
    seq_len: int,
    post: tuple[str, ...],
    temperature: float,
    want_entropy: bool,
    top_k: int = 0,
    head: LMHead | None = None,
    reads: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One model call; ``logprobs`` (and ``entropy``, ``top_logprobs``/``top_ids``) as ``[b, S]``.

    ``mb`` must already be on the model's device; ``head`` (None: whole logits) chunks the LM
    head when the microbatch needs it, and then computes only the positions ``reads`` (``[b, S]``
    bool, None: all) marks; the others hold 0.
    """
    wanted = None if reads is None else reads[mb.token_rows, mb.token_cols]
    state = ScoringState(
        logits=model_logits(model, mb, head, wanted),
        targets=mb.targets,
        temperature=temperature,
        want_entropy=want_entropy,
        top_k=top_k,
    )
    run_post_processors(post, state)
    rows = mb.rows.numel()
    out = {"logprobs": _to_rows(state.logprobs, mb, rows, seq_len)}
    if state.entropy is not None:
        out["entropy"] = _to_rows(state.entropy, mb, rows, seq_len)
    if top_k:
        values, ids = state.top
        out["top_logprobs"] = _to_rows(values, mb, rows, seq_len)
        out["top_ids"] = _to_rows(ids, mb, rows, seq_len)
    return out


def scored_microbatches(
    model: torch.nn.Module,
    request: Request,
    device: torch.device,
    *,
    top_k: int = 0,
    head: LMHead | None = None,
    loss_positions_only: bool = False,
) -> Iterator[
    tuple[MicroBatch | SharedMicroBatch, dict[str, torch.Tensor], dict[str, torch.Tensor]]
]:
    """Yield ``(microbatch, outputs, loss rows)`` for each microbatch of ``request``, in order.

    ``loss rows`` are the microbatch's rows of the prepared loss's tensors, on ``device`` (empty
    when the request has no loss). Gradients flow if the caller enables them. With
    ``loss_positions_only`` (a backward pass whose outputs only the loss sees), a chunked head
    scores only the positions the loss reads (:attr:`PreparedLoss.reads`).
    """
    for mb in request.plan:
        cancellation.check()  # between microbatches: a cancelled op stops here
        reads = None
        if loss_positions_only and request.loss is not None:
            reads = request.loss.reads.index_select(0, mb.rows).to(device)
        outputs = score(
            model,
            mb.to(device),
            seq_len=request.batch.seq_len,
            post=request.processing.post,
            temperature=request.meta.temperature,
            want_entropy=request.want_entropy,
            top_k=top_k,
            head=head,
            reads=reads,
        )
        rows = {}
        if request.loss is not None:
            rows = {
                name: t.index_select(0, mb.rows).to(device)
                for name, t in request.loss.tensors.items()
            }
        yield mb, outputs, rows


@torch.no_grad()
def forward_no_grad(
    model: torch.nn.Module,
    request: Request,
    device: torch.device,
    *,
    top_k: int = 0,
    head: LMHead | None = None,
) -> dict:
    """``fwd_no_grad``: ``[B, S]`` float32 ``logprobs`` (+ ``entropy``), on CPU, and metrics.

    With a loss in the request, its metrics are computed too and ``avg_loss``/``loss`` are added.
    The model is put in eval mode for the call and restored afterwards.
    """
    was_training = model.training
    model.eval()
    try:
        size, seq_len = request.batch.size, request.batch.seq_len
        result: dict[str, torch.Tensor] = {}
        sums = MetricSums()
        sums.add(request.sharing_metrics())
        scored = scored_microbatches(model, request, device, top_k=top_k, head=head)
        for mb, outputs, rows in scored:
            for name, value in outputs.items():
                if name not in result:
                    result[name] = torch.zeros((size, seq_len, *value.shape[2:]), dtype=value.dtype)
                result[name][mb.rows] = value.cpu()
            if request.loss is not None:
                sums.add(request.loss(outputs, rows).metrics)
    finally:
        model.train(was_training)
    response: dict = {**result, "metrics": sums.finalize()}
    if request.loss is not None:
        response.update(loss_fields(response["metrics"]))
        response["metric_sums"] = sums.raw()
    return response


def _to_rows(
    values: torch.Tensor, mb: MicroBatch | SharedMicroBatch, rows: int, seq_len: int
) -> torch.Tensor:
    """Model-layout ``[r, T, ...]`` values at predicting positions -> ``[rows, S, ...]``."""
    flat = values.reshape(-1, *values.shape[2:])[mb.pred_index]
    out = torch.zeros((rows, seq_len, *values.shape[2:]), dtype=values.dtype, device=values.device)
    return out.index_put((mb.token_rows, mb.token_cols), flat)


def check_top_k(top_k, vocab_size: int) -> int:
    """``top_k`` must be an integer in ``[0, vocab_size]``."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= vocab_size:
        raise EngineInputError("top_k", f"expected an integer in [0, {vocab_size}], got {top_k!r}")
    return top_k
