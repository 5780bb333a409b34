"""Decode-sized products on CPU through oneDNN's pre-packed weights.

A decode step multiplies a few rows (one per sequence) by every weight of the model. On CPU,
``torch.nn.functional.linear`` calls MKL's sgemm, which re-packs the whole weight into its blocked
layout on every call; from 16 rows up (4 for weights of 2048 x 1024 elements or more; below that
MKL takes a small-matrix path) the re-pack costs about as much as the product itself at decode
sizes. A weight packed once for oneDNN (what inductor's CPU freezing and vLLM's CPU backend use)
skips it. ``benchmarks/packed_linear.py`` measures each case against ``F.linear`` on this
project's 2-core machine: the packed product is faster for 16-256 rows of a float32 weight of
512 x 512 elements or more, and for 4-256 rows of one of 2048 x 1024 or more; it is slower for
fewer rows, where the call's fixed cost dominates, no faster for prefill-sized inputs, and for
smaller weights what it saves does not pay for the routing.

So :func:`install` gives each float32 linear layer of the sampler's CPU model with at least
``MIN_ELEMENTS`` weight elements a packed copy of its weight, used for inputs of
:func:`packed_rows` rows; every other call takes ``F.linear``. The copy is made on first use and
again after the weight changed: another tensor or storage, or an in-place write through the
parameter, which bumps its version. A write through ``.data``, the storage or numpy does not, so
the sampler also :func:`refresh` es the copies after each of its weight loads (which puts the
re-pack in the load's time). Results equal ``F.linear``'s to float rounding (oneDNN sums in
another order), not bit for bit; :func:`bypassed` turns the routing off where a result must equal
the trainer's. The copies double the memory of the weights they copy; :func:`release` drops them
(the sampler's sleep at level 2).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MIN_ELEMENTS = 512 * 512  # smaller weights: the saving does not pay for the routing
LARGE_ELEMENTS = 2048 * 1024  # from here MKL's small-matrix path ends at 4 rows, not 16
FIRST_ROW, FIRST_ROW_LARGE, LAST_ROW = 16, 4, 256  # input rows (tokens) that take the copy
_BYPASSED: ContextVar[bool] = ContextVar("packed_linear_bypassed", default=False)  # bypassed()


def _op(name: str):
    packet = getattr(torch.ops.mkldnn, name, None)
    return None if packet is None else packet.default


_REORDER = _op("_reorder_linear_weight")  # the overloads themselves: a packet call costs more
_LINEAR = _op("_linear_pointwise")


def available() -> bool:
    """Whether this torch build has oneDNN's packed linear and takes ``F.linear`` to MKL, whose
    per-call re-pack the packing avoids (x86 builds; the rule was measured there)."""
    return (
        torch.backends.mkldnn.is_available()
        and torch.backends.mkl.is_available()
        and None not in (_REORDER, _LINEAR)
    )


def install(model: nn.Module) -> int:
    """Route ``model``'s large float32 CPU linear layers through packed weights (see the module
    docstring); returns how many layers were routed (0 where oneDNN is unavailable)."""
    if not available():
        log.info("sampler linear layers: no oneDNN packing with MKL here, F.linear for all")
        return 0
    routed = 0
    for module in model.modules():
        if type(module) is nn.Linear and _packable(module.weight):
            module.forward = PackedLinear(module)
            routed += 1
    return routed


def refresh(model: nn.Module) -> None:
    """Pack again now every copy ``model`` holds, after a weight load: the load pays for it, not
    the next decode step, and a copy is right even if the load wrote past the version counter."""
    for layer in _routed(model):
        layer.refresh()


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Every routed layer takes ``F.linear`` inside (scoring that must equal the trainer's)."""
    token = _BYPASSED.set(True)
    try:
        yield
    finally:
        _BYPASSED.reset(token)


def release(model: nn.Module) -> int:
    """Drop ``model``'s packed copies (each is made again at its layer's next packed call), as
    sleep does to free memory; returns the bytes of the weights they copied."""
    return sum(layer.release() for layer in _routed(model))


def _routed(model: nn.Module) -> list[PackedLinear]:
    return [m.forward for m in model.modules() if isinstance(m.forward, PackedLinear)]


def packed_rows(elements: int) -> range:
    """The input row counts that take the packed copy of a weight of ``elements`` elements
    (empty: the weight is not packed)."""
    if elements < MIN_ELEMENTS:
        return range(0)
    return range(FIRST_ROW_LARGE if elements >= LARGE_ELEMENTS else FIRST_ROW, LAST_ROW + 1)


def _packable(weight: torch.Tensor) -> bool:
    """A weight whose changes the packed copy can follow (an inference tensor has no version
    counter) and that the packed product is faster for."""
    return (
        not weight.is_inference()
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.layout == torch.strided
        and len(packed_rows(weight.numel())) > 0
    )


class PackedLinear:
    """A linear layer's forward: the packed weight for inputs of :func:`packed_rows` rows,
    ``F.linear`` otherwise. The packed copy is rebuilt when the weight is not the one it was
    packed from."""

    def __init__(self, module: nn.Linear) -> None:
        self.module = module
        self._packed: torch.Tensor | None = None  # None: not packed, or the weight is not packable
        self._weight: torch.Tensor | None = None  # the tensor it was packed from
        self._stamp: tuple[int, int] | None = None  # that tensor's data pointer and version then

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        if (
            rows in packed_rows(weight.numel())
            and not (torch.is_grad_enabled() and _needs_grad(x, weight, bias))
            and not _BYPASSED.get()
        ):
            packed = self._packed_weight(weight)
            if packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
                out = _LINEAR(x.reshape(rows, features), packed, bias, "none", [], "")
                return out.reshape(*x.shape[:-1], out.shape[-1])
        return F.linear(x, weight, bias)

    def refresh(self) -> None:
        """Pack the weight again now if a copy is held (else the next packed call packs it)."""
        if self._packed is not None:
            self._weight = None
            self._packed_weight(self.module.weight)

    def release(self) -> int:
        """Drop the packed copy; returns the bytes of the weight it copied (0: none held)."""
        held = self._packed is not None and self._weight is not None
        nbytes = self._weight.numel() * self._weight.element_size() if held else 0
        self._packed = self._weight = self._stamp = None
        return nbytes

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed copy behind (an opaque tensor; made again)."""
        return {**self.__dict__, "_packed": None, "_weight": None, "_stamp": None}

    def _packed_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        if weight.is_inference():  # no version counter to tell a stale copy by
            self._packed = self._weight = self._stamp = None
            return None
        stamp = (weight.data_ptr(), weight._version)
        if self._weight is not weight or self._stamp != stamp:
            self._packed = _REORDER(weight.detach(), FIRST_ROW) if _packable(weight) else None
            self._weight, self._stamp = weight, stamp
        return self._packed


def _needs_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
