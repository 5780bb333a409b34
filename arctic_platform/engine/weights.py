"""Weight sync from the trainer to the sampler: export, in-process copy, and chunked streams.

Names are always those of the plain ``transformers`` model (``model.layers.0.mlp.up_proj.weight``),
whatever wraps the trainer's model, so a sampler (ours or a vLLM one later) never needs to know how
the trainer was built.

- :func:`export_weights` walks the trainer's weights. A peft LoRA model is exported *merged*:
  each adapted weight is ``W + scaling * B @ A`` computed into a new tensor (the training model is
  not touched) and the adapter tensors are dropped. Tied weights (the embedding shared with the
  LM head) are exported once, under the first name the model lists (``model.embed_tokens.weight``).
- :func:`snapshot_adapters` copies a LoRA model's adapter tensors (small: rank x width per
  layer); ``export_weights(model, adapters=snapshot)`` later exports the weights *as they were at
  the snapshot*: the base weights are frozen, so base + the snapshot's delta is that model exactly,
  however far training has moved since (Tinker's sampler snapshots).
- :func:`sync_in_process` copies straight from the trainer's tensors into the sampler's (no disk,
  no serialisation), one tensor at a time.
- :func:`stream_weights` / :func:`iter_weights_from_chunks` carry the weights across a process
  boundary as a sequence of safetensors blobs of bounded size; the receiving side feeds the
  result to ``SamplingEngine.load_weights``.

Failure safety. A stream's first chunk carries a manifest (every name, dtype and shape) and every
chunk carries the stream id and its index, so the receiver checks the whole stream's names and
shapes against the model before it changes anything, and checks each chunk completely before
copying from it. What cannot be checked in advance with bounded memory is a chunk that arrives
damaged (truncated, out of order, missing) after earlier chunks were applied; then
:class:`WeightLoadError` says how many tensors were already written (``applied``), and the sampler
refuses to generate until a complete load succeeds, rather than sampling from a mix of old and new
weights.
"""

from __future__ import annotations

import json
import struct
import sys
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from arctic_platform.engine.errors import EngineInputError

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
_STREAM_KEY = "arctic.weights"
_MANIFEST_KEY = "arctic.manifest"
_STREAM_VERSION = 1


class WeightLoadError(EngineInputError):
    """Bad weights; ``applied`` tensors had already been written when it was detected (0: none)."""

    def __init__(self, field: str, message: str, applied: int = 0) -> None:
        self.reason = message
        if applied:
            message = f"{message} ({applied} tensor(s) were already applied before this failure)"
        super().__init__(field, message)
        self.applied = applied


# ----------------------------------------------------------------------------------------------
# Export


@dataclass(frozen=True)
class _Entry:
    """One exported tensor: its spec, and how to produce it when its turn comes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


Manifest = dict[str, tuple[torch.dtype, tuple[int, ...]]]


class WeightSource(ABC):
    """Named tensors with a manifest known before any tensor is produced.

    Iterating yields ``(name, tensor)``; :meth:`groups` yields the same tensors in the groups the
    source produces them in (one chunk of a stream; one tensor for an in-process export), which is
    the unit :func:`load_into_model` validates before applying.
    """

    @property
    @abstractmethod
    def manifest(self) -> Manifest:
        """Every tensor's name, dtype and shape, available before the first tensor."""

    @abstractmethod
    def groups(self) -> Iterator[dict[str, torch.Tensor]]:
        """The tensors, in the groups the source produces them in."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for group in self.groups():
            yield from group.items()


class ExportedWeights(WeightSource):
    """The weights of a live model, produced one tensor at a time (see :func:`export_weights`)."""

    def __init__(self, entries: list[_Entry]) -> None:
        self._entries = entries

    @property
    def manifest(self) -> Manifest:
        return {e.name: (e.dtype, e.shape) for e in self._entries}

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def groups(self) -> Iterator[dict[str, torch.Tensor]]:
        for entry in self._entries:
            yield {entry.name: entry.produce()}


def export_weights(
    model: torch.nn.Module, adapters: AdapterSnapshot | None = None
) -> ExportedWeights:
    """The model's current weights in plain ``transformers`` naming, LoRA merged (see module doc);
    with ``adapters`` (a :func:`snapshot_adapters` of this model), the weights at that snapshot.

    Tensors are produced lazily while iterating: plain weights are detached views of the model's
    own tensors (no copy), merged LoRA weights are new tensors. Iterate once per export.
    """
    return ExportedWeights(_export_plan(model, adapters))


@dataclass(frozen=True)
class _FrozenLora:
    """Copies of one LoRA layer's adapter tensors, merged the way peft's ``get_delta_weight``
    merges a ``Linear`` (fp32 on CPU for half types, ``fan_in_fan_out`` transposed)."""

    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    b_bias: dict[str, torch.Tensor]
    scaling: dict[str, float]
    fan_in_fan_out: bool

    def delta(self, adapter: str, leaf: str) -> torch.Tensor | None:
        if leaf == "bias":
            bias = self.b_bias.get(adapter)
            return None if bias is None else bias * self.scaling[adapter]
        a, b = self.a[adapter], self.b[adapter]
        half = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
        out = (b.float() @ a.float()) if half else b @ a
        if self.fan_in_fan_out:
            out = out.T
        out = out * self.scaling[adapter]
        return out.to(b.dtype) if half else out


AdapterSnapshot = dict[str, _FrozenLora]


def snapshot_adapters(model: torch.nn.Module) -> AdapterSnapshot:
    """Copies of the model's LoRA adapter tensors, for :func:`export_weights` (see module doc)."""
    _, adapted = _unwrap_peft(model)
    snapshot: AdapterSnapshot = {}
    with torch.no_grad():
        for path, layer in adapted.items():
            adapters = _unmerged_active_adapters(layer)
            if any(a in layer.lora_embedding_A for a in adapters):
                raise TypeError(f"{path}: adapter snapshots cover LoRA on linear layers only")
            snapshot[path] = _FrozenLora(
                a={a: layer.lora_A[a].weight.detach().clone() for a in adapters},
                b={a: layer.lora_B[a].weight.detach().clone() for a in adapters},
                b_bias={
                    a: layer.lora_B[a].bias.detach().clone()
                    for a in adapters
                    if layer.lora_bias.get(a, False)
                },
                scaling={a: float(layer.scaling[a]) for a in adapters},
                fan_in_fan_out=bool(layer.fan_in_fan_out),
            )
    return snapshot


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA model's weights at one moment, kept as copies of its adapters (a trainer's
    ``weight_snapshot``): the base weights are frozen, so merging the copies into them at load
    time gives the weights of the moment the copies were taken."""

    model: torch.nn.Module
    adapters: AdapterSnapshot

    def load_into(self, sampler) -> dict:
        """Load the merged weights into ``sampler`` (an engine in this process); its report."""
        return sampler.load_weights(export_weights(self.model, adapters=self.adapters))


def _export_plan(model: torch.nn.Module, snapshot: AdapterSnapshot | None = None) -> list[_Entry]:
    base, adapted = _unwrap_peft(model)
    state = base.state_dict(keep_vars=True)
    aliases: dict[int, int] = {}
    for tensor in state.values():
        aliases[id(tensor)] = aliases.get(id(tensor), 0) + 1
    entries: list[_Entry] = []
    seen: set[int] = set()
    for name, tensor in state.items():
        if id(tensor) in seen:
            continue  # a tied alias (e.g. lm_head.weight sharing the embedding)
        seen.add(id(tensor))
        owner, _, leaf = name.rpartition(".")
        layer_path = _adapted_layer_of(owner, adapted)
        if layer_path is None:
            entries.append(_plain_entry(name, tensor))
            continue
        if owner != f"{layer_path}.base_layer":
            continue  # the adapter's own tensors (lora_A, lora_B, ...): folded into the merge
        if aliases[id(tensor)] > 1:
            raise ValueError(
                f"{name}: a LoRA adapter on a tied weight cannot be exported merged (the tied "
                "copy would not see the adapter); untie the weights or do not adapt this module"
            )
        layer = adapted[layer_path]
        if snapshot is None:
            delta = partial(_live_delta, layer)
            adapters = _unmerged_active_adapters(layer)
        else:
            if layer_path not in snapshot:
                raise ValueError(f"{layer_path}: not in the adapter snapshot (another model's?)")
            delta = snapshot[layer_path].delta
            adapters = list(snapshot[layer_path].a)
        entries.append(_merged_entry(f"{layer_path}.{leaf}", tensor, adapters, delta, leaf))
    return entries


def _plain_entry(name: str, tensor: torch.Tensor) -> _Entry:
    return _Entry(name, tensor.dtype, tuple(tensor.shape), tensor.detach)


def _live_delta(layer, adapter: str, leaf: str) -> torch.Tensor | None:
    """The adapter's delta to ``leaf`` of the live LoRA ``layer`` (None: it has none)."""
    if leaf == "weight":
        return layer.get_delta_weight(adapter)
    if leaf == "bias" and layer.lora_bias.get(adapter, False):
        return layer.lora_B[adapter].bias * layer.scaling[adapter]
    return None


def _merged_entry(
    name: str,
    tensor: torch.Tensor,
    adapters: list[str],
    delta_of: Callable[[str, str], torch.Tensor | None],
    leaf: str,
) -> _Entry:
    def produce() -> torch.Tensor:
        with torch.no_grad():
            out = tensor.detach()
            for adapter in adapters:
                delta = delta_of(adapter, leaf)
                if delta is not None:
                    out = out + delta.to(out.dtype)
            return out

    return _Entry(name, tensor.dtype, tuple(tensor.shape), produce)


def _unwrap_peft(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    """``(plain transformers model, {module path: LoRA layer})``; no peft import if unused."""
    peft = sys.modules.get("peft")
    if peft is None:
        return model, {}
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import other

    # Wrappers that keep trainable copies of whole modules (modules_to_save and the like).
    wrappers = tuple(
        getattr(other, name)
        for name in ("AuxiliaryTrainingWrapper", "ModulesToSaveWrapper")
        if hasattr(other, name)
    )
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    adapted: dict[str, torch.nn.Module] = {}
    for path, module in base.named_modules():
        if isinstance(module, LoraLayer):
            adapted[path] = module
        elif isinstance(module, (BaseTunerLayer, *wrappers)):
            raise TypeError(
                f"{path}: weight export supports peft LoRA adapters only, found "
                f"{type(module).__name__}"
            )
    return base, adapted


def _unmerged_active_adapters(layer) -> list[str]:
    if layer.disable_adapters:
        return []
    adapters = [
        a for a in layer.active_adapters if a in layer.lora_A or a in layer.lora_embedding_A
    ]
    variants = [a for a in adapters if a in getattr(layer, "lora_variant", {})]
    if variants:
        raise TypeError(
            f"weight export merges plain LoRA only; adapter(s) {variants} use a LoRA variant "
            "(DoRA or similar)"
        )
    return [a for a in adapters if a not in layer.merged_adapters]


def _adapted_layer_of(module_path: str, adapted: Mapping[str, torch.nn.Module]) -> str | None:
    """The LoRA layer that ``module_path`` belongs to (itself or an ancestor), if any."""
    if not adapted:
        return None
    parts = module_path.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in adapted:
            return prefix
    return None


# ----------------------------------------------------------------------------------------------
# Loading into a model


Weights = WeightSource | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def load_into_model(model: torch.nn.Module, weights: Weights) -> dict:
    """Copy named tensors into ``model``'s parameters and buffers in place.

    Validation comes first wherever the input allows it: a :class:`WeightSource` (an export or a
    stream) has its manifest checked against the model before anything is written and then each
    group is checked before it is copied; a mapping, list or tuple is checked entirely first; any
    other iterable is checked tensor by tensor. Names are the model's ``state_dict`` names (a tied
    alias such as ``lm_head.weight`` is accepted); shapes must match; floating tensors convert to
    the parameter's dtype. Returns ``{"tensors", "bytes", "complete"}``, ``complete`` meaning that
    every tensor of the model was written.
    """

    def copy(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            target.copy_(tensor)

    return apply_weights(model.state_dict(keep_vars=True), weights, copy)


def collect_weights(
    targets: Mapping[str, torch.Tensor],
    weights: Weights,
    device: torch.device | str | None = "cpu",
    copy: bool = True,
    convert: bool = True,
) -> tuple[dict, dict]:
    """Validate ``weights`` against ``targets`` (a ``state_dict``, possibly of a model on the
    ``meta`` device) exactly as :func:`load_into_model` does, and return ``(tensors, report)``:
    contiguous copies in the target dtypes on ``device`` (None: each tensor's own) under the
    first name of each tensor (tied aliases folded), and the ``{"tensors", "bytes", "complete"}``
    report. With ``copy=False`` a tensor that already has that device, dtype and layout is kept
    as it is (detached), for a caller that reads it before its owner changes it. With
    ``convert=False`` each tensor keeps its own dtype (for a caller that converts later)."""
    first_name = {}
    for name, target in targets.items():
        first_name.setdefault(id(target), name)
    collected: dict[str, torch.Tensor] = {}

    def keep(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
        where = tensor.device if device is None else device
        dtype = target.dtype if convert else None
        copied = tensor.detach().to(where, dtype=dtype, copy=copy).contiguous()
        collected[first_name[id(target)]] = copied

    report = apply_weights(targets, weights, keep)
    return collected, report


def apply_weights(
    targets: Mapping[str, torch.Tensor],
    weights: Weights,
    write: Callable[[str, torch.Tensor, torch.Tensor], None],
) -> dict:
    """Check ``weights`` against ``targets`` (see :func:`load_into_model`) and ``write(name,
    target, tensor)`` each one once its group passed; returns the load report."""
    written: set[int] = set()
    counts = {"tensors": 0, "bytes": 0}

    def apply(group: Mapping[str, torch.Tensor] | list[tuple[str, torch.Tensor]]) -> None:
        items = list(group.items()) if isinstance(group, Mapping) else group
        checked = [
            (_check_target(targets, name, tensor, counts["tensors"]), tensor)
            for name, tensor in items
        ]
        for (name, _), (target, tensor) in zip(items, checked, strict=True):
            write(name, target, tensor)
            written.add(id(target))
            counts["tensors"] += 1
            counts["bytes"] += tensor.numel() * tensor.element_size()

    try:
        if isinstance(weights, WeightSource):
            for name, (dtype, shape) in weights.manifest.items():
                _check_spec(targets, name, dtype, shape, applied=0)
            for group in weights.groups():
                apply(group)
        elif isinstance(weights, Mapping):
            apply(weights)
        elif isinstance(weights, (list, tuple)):
            apply(list(weights))
        else:
            for item in weights:
                if not (isinstance(item, tuple) and len(item) == 2):
                    raise WeightLoadError(
                        "weights", f"expected (name, tensor) pairs, got {item!r}", counts["tensors"]
                    )
                apply([item])
    except Exception as err:
        applied = counts["tensors"]
        if not applied or getattr(err, "applied", 0) == applied:
            raise
        # Failed part-way (a damaged chunk, a failing producer): say how much was written.
        field = err.field if isinstance(err, EngineInputError) else "weights"
        reason = getattr(err, "reason", None) or getattr(err, "message", None) or repr(err)
        raise WeightLoadError(field, reason, applied) from err
    complete = {id(t) for t in targets.values()} <= written
    return {**counts, "complete": complete}


def _check_spec(
    targets: Mapping[str, torch.Tensor],
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    applied: int,
) -> torch.Tensor:
    field = f"weights[{name}]"
    target = targets.get(name)
    if target is None:
        raise WeightLoadError(field, "no such tensor in the model", applied)
    if tuple(shape) != tuple(target.shape):
        raise WeightLoadError(
            field, f"shape {list(shape)} does not match the model's {list(target.shape)}", applied
        )
    if dtype != target.dtype and not (dtype.is_floating_point and target.dtype.is_floating_point):
        raise WeightLoadError(
            field, f"dtype {dtype} cannot be loaded into the model's {target.dtype}", applied
        )
    return target


def _check_target(targets: Mapping[str, torch.Tensor], name, tensor, applied: int) -> torch.Tensor:
    if not isinstance(name, str):
        raise WeightLoadError("weights", f"tensor names must be strings, got {name!r}", applied)
    if not isinstance(tensor, torch.Tensor):
        raise WeightLoadError(
            f"weights[{name}]", f"expected a tensor, got {type(tensor).__name__}", applied
        )
    return _check_spec(targets, name, tensor.dtype, tuple(tensor.shape), applied)


def sync_in_process(source_model: torch.nn.Module, target) -> dict:
    """Make ``target`` (a ``SamplingEngine`` or a model) hold ``source_model``'s current weights.

    Tensors are copied directly from the source's memory into the target's, one at a time
    (LoRA layers merged on the fly), after the names and shapes were checked.
    """
    weights = export_weights(source_model)
    if isinstance(target, torch.nn.Module):
        return load_into_model(target, weights)
    return target.load_weights(weights)


# ----------------------------------------------------------------------------------------------
# Streams of safetensors chunks


def stream_weights(
    model: torch.nn.Module, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[bytes]:
    """Serialise the model's exported weights as safetensors blobs of at most ``chunk_bytes``.

    Tensors are grouped in export order; a tensor larger than ``chunk_bytes`` travels alone. Only
    the current chunk's tensors are materialised. The first chunk's metadata holds the manifest.
    """
    from safetensors.torch import save

    if chunk_bytes < 1:
        raise EngineInputError("chunk_bytes", f"must be >= 1, got {chunk_bytes}")
    entries = _export_plan(model)
    groups: list[list[_Entry]] = []
    size = 0
    for entry in entries:
        if not groups or (size + entry.nbytes > chunk_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    stream_id = uuid.uuid4().hex
    manifest = [[e.name, _dtype_name(e.dtype), list(e.shape)] for e in entries]
    for index, group in enumerate(groups or [[]]):
        header = {"version": _STREAM_VERSION, "stream": stream_id, "chunk": index}
        header["num_chunks"] = max(len(groups), 1)
        metadata = {_STREAM_KEY: json.dumps(header)}
        if index == 0:
            metadata[_MANIFEST_KEY] = json.dumps(manifest)
        tensors = {e.name: e.produce().detach().to("cpu").contiguous() for e in group}
        yield save(tensors, metadata=metadata)


def iter_weights_from_chunks(chunks: Iterable[bytes]) -> WeightStream:
    """Decode a chunk stream made by :func:`stream_weights` into ``(name, tensor)`` pairs.

    The result is lazy and reads one chunk at a time; it checks the stream as it goes (see
    :class:`WeightStream`) and is meant for ``SamplingEngine.load_weights``.
    """
    return WeightStream(chunks)


class WeightStream(WeightSource):
    """The receiving side of a chunk stream; every check raises :class:`WeightLoadError`.

    Checks: each chunk is a well-formed safetensors blob of this stream (same id, next index);
    the first carries the manifest; every tensor is listed there with the same dtype and shape and
    arrives once; the stream ends after ``num_chunks`` chunks with every listed tensor delivered.
    """

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._first: tuple[dict, dict[str, torch.Tensor]] | None = None
        self._manifest: Manifest | None = None
        self._started = False

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._read_first()
        return self._manifest

    def groups(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a WeightStream can be consumed only once")
        self._started = True
        header, tensors = self._read_first()
        stream_id, total = header["stream"], header["num_chunks"]
        manifest = self._manifest
        delivered: set[str] = set()
        index = 0
        while True:
            for name, tensor in tensors.items():
                self._check_tensor(index, name, tensor, manifest, delivered)
            delivered.update(tensors)
            yield tensors
            index += 1
            blob = next(self._chunks, None)
            if blob is None:
                break
            header, tensors = _decode_chunk(blob, index)
            if header["stream"] != stream_id:
                raise WeightLoadError(f"weights.chunk[{index}]", "belongs to a different stream")
            if header["chunk"] != index or header["num_chunks"] != total:
                raise WeightLoadError(
                    f"weights.chunk[{index}]",
                    f"out of order: it says chunk {header['chunk']} of {header['num_chunks']}, "
                    f"expected chunk {index} of {total}",
                )
        if index != total:
            raise WeightLoadError("weights", f"the stream ended after {index} of {total} chunks")
        missing = sorted(set(manifest) - delivered)
        if missing:
            raise WeightLoadError("weights", f"tensors listed but never sent: {missing[:5]}")

    def _read_first(self) -> tuple[dict, dict[str, torch.Tensor]]:
        if self._first is None:
            blob = next(self._chunks, None)
            if blob is None:
                raise WeightLoadError("weights", "the stream is empty")
            header, tensors = _decode_chunk(blob, 0)
            if header["chunk"] != 0 or _MANIFEST_KEY not in header["metadata"]:
                raise WeightLoadError(
                    "weights.chunk[0]", "the stream must start with chunk 0, which has the manifest"
                )
            self._manifest = _parse_manifest(header["metadata"][_MANIFEST_KEY])
            self._first = (header, tensors)
        return self._first

    @staticmethod
    def _check_tensor(index, name, tensor, manifest: Manifest, delivered: set[str]) -> None:
        field = f"weights.chunk[{index}][{name}]"
        if name not in manifest:
            raise WeightLoadError(field, "not listed in the stream's manifest")
        if name in delivered:
            raise WeightLoadError(field, "sent twice")
        dtype, shape = manifest[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise WeightLoadError(
                field,
                f"{tensor.dtype} {list(tensor.shape)} does not match the manifest's "
                f"{dtype} {list(shape)}",
            )


def _decode_chunk(blob: bytes, index: int) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load

    field = f"weights.chunk[{index}]"
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise WeightLoadError(field, f"expected bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    try:
        (header_len,) = struct.unpack("<Q", blob[:8])
        metadata = json.loads(blob[8 : 8 + header_len]).get("__metadata__") or {}
        tensors = load(blob)
    except Exception as err:  # safetensors raises its own error type; any failure means "bad blob"
        raise WeightLoadError(field, f"not a valid safetensors blob: {err}") from err
    try:
        header = json.loads(metadata[_STREAM_KEY])
        if header.get("version") != _STREAM_VERSION:
            raise ValueError(f"unsupported stream version {header.get('version')!r}")
        for key in ("stream", "chunk", "num_chunks"):
            if key not in header:
                raise ValueError(f"missing {key!r}")
    except (KeyError, ValueError, TypeError) as err:
        raise WeightLoadError(field, f"not a chunk of a weight stream ({err})") from err
    header["metadata"] = metadata
    return header, tensors


def _parse_manifest(text: str) -> Manifest:
    try:
        manifest = {}
        for name, dtype_name, shape in json.loads(text):
            dtype = getattr(torch, dtype_name)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {dtype_name!r}")
            manifest[name] = (dtype, tuple(int(s) for s in shape))
        return manifest
    except (ValueError, TypeError, AttributeError) as err:
        raise WeightLoadError("weights.chunk[0]", f"malformed manifest ({err})") from err


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
