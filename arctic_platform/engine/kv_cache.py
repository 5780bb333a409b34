"""A preallocated key/value cache for batched decoding with transformers models.

``DynamicCache`` concatenates every layer's keys and values at every step, copying the whole cache
each time; ``StaticCache`` avoids the copy but makes attention read the full preallocated length.
This cache does neither: each layer owns buffers that are written in place, and attention reads
views of the filled columns only.

Each layer keeps two stores (:mod:`arctic_platform.engine.shared_prefix` says why):

- the **prefix store** ``[groups, kv_heads, prefix_width, head_dim]``: the keys/values of each
  prefilled prompt, once, however many samples decode from it (``prefill_groups``); prompts are
  left-padded and right-aligned at ``prefix_width``;
- the **suffix store** ``[rows, kv_heads, capacity, head_dim]``: each row's generated tokens. All
  rows share one write column (a row that joined later is left-padded), which is what keeps
  every step a single batched call.

It adds what the sampler needs on top of a plain cache:

- **compaction**: rows of finished sequences, and groups no row reads any more, are dropped with
  one gather per layer (``keep``), so later steps only compute what is still running;
- **joining**: rows and groups that join a running batch (:mod:`.running_batch`) get new slots;
  ``relayout`` moves what is kept into the new geometry (dropping the suffix columns no kept
  row uses, left-padding whichever side is shorter) and the newcomers' prompts are prefilled
  into their groups;
- **prefixes from elsewhere**: a prompt's keys and values copied in (``write_prefix``, from the
  prompt cache), whole or its first tokens; a prefill of the rest attends to those columns and
  writes only its own tokens' (``prefill_groups`` with ``written``);
- **buffer reuse**: buffers come from a :class:`KVBufferPool`, which keeps them across batches and
  calls (no re-allocation per step or per call) until the sampler goes to sleep and releases them.

Columns a row never wrote but attention reads (its padding) hold zeros, never stale memory: a
masked position weighs exactly 0, and 0 times a stale NaN would still poison the row.
Only full-attention layers are supported (no sliding-window or linear-attention layers).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# The pool's buffers of one layer (each holds the prefix store, then the suffix store).
KEYS, VALUES = 0, 1


@dataclass(frozen=True)
class Geometry:
    """The cache's shape: ``groups`` prompts of ``prefix_width`` columns, ``rows`` completions of
    ``capacity`` columns."""

    groups: int
    prefix_width: int
    rows: int
    capacity: int

    def nbytes(self, per_token: int) -> int:
        """Bytes of every layer's keys and values, ``per_token`` bytes per token."""
        return (self.groups * self.prefix_width + self.rows * self.capacity) * per_token


@dataclass(frozen=True)
class PrefillTarget:
    """Where a prefill forward writes (see :meth:`KVCache.prefill_groups`)."""

    first: int
    at: int
    past: int
    written: torch.Tensor | None


class KVBufferPool:
    """Keeps one flat buffer per (layer, keys|values) and hands out shaped views of it.

    A request for a shape that fits the buffer reuses it; a larger one replaces it. ``release``
    drops everything (the sampler's sleep), ``reserve`` re-creates the last sizes (its wake).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._last_sizes: dict[tuple[int, int], tuple[int, torch.dtype, torch.device]] = {}

    def views(
        self, key: tuple[int, int], shapes: list[tuple[int, ...]], dtype: torch.dtype, device
    ) -> list[torch.Tensor]:
        """Consecutive regions of one buffer, shaped ``shapes`` (contents undefined)."""
        sizes = [math.prod(shape) for shape in shapes]
        numel = sum(sizes)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            self._buffers.pop(key, None)  # free the old one before allocating the new one
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        elif buffer.device != torch.device(device):
            buffer = self._buffers[key] = torch.empty(buffer.numel(), dtype=dtype, device=device)
        self._last_sizes[key] = (buffer.numel(), dtype, buffer.device)
        regions = buffer[:numel].split(sizes)
        return [region.view(shape) for region, shape in zip(regions, shapes, strict=True)]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def release(self) -> int:
        """Drop every buffer; return the bytes released."""
        released = self.nbytes
        self._buffers.clear()
        return released

    def reserve(self) -> int:
        """Allocate again the buffers released last (same sizes); return the bytes allocated."""
        for key, (numel, dtype, device) in self._last_sizes.items():
            if key not in self._buffers:
                self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return self.nbytes


class _PreallocatedLayer(CacheLayerMixin):
    """One layer's stores; see :class:`KVCache`."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: KVCache, index: int) -> None:
        super().__init__()
        self._cache = cache
        self._index = index
        self.length = 0  # the suffix columns written

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Head counts and sizes come from the first states seen, so any full-attention model works.
        self.dtype, self.device = key_states.dtype, key_states.device
        self.heads = key_states.shape[1]
        self.dims = (key_states.shape[-1], value_states.shape[-1])
        self.take_views(self._cache.geometry)
        self.is_initialized = True

    def take_views(self, geometry: Geometry) -> None:
        """Point the stores at views of ``geometry`` in the pool (contents undefined). Keys and
        values each take one buffer, prefix store first, so the cache never holds more than
        the geometry however its split between prompts and completions moves."""
        for kind, dim in ((KEYS, self.dims[0]), (VALUES, self.dims[1])):
            prefix, suffix = self._cache.pool.views(
                (self._index, kind),
                [
                    (geometry.groups, self.heads, geometry.prefix_width, dim),
                    (geometry.rows, self.heads, geometry.capacity, dim),
                ],
                self.dtype,
                self.device,
            )
            if kind == KEYS:
                self.prefix_keys, self.keys = prefix, suffix
            else:
                self.prefix_values, self.values = prefix, suffix

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache = self._cache
        target = cache.prefill_target
        if target is not None:
            groups, width = key_states.shape[0], key_states.shape[-2]
            rows = slice(target.first, target.first + groups)
            columns = slice(target.at, target.at + width)
            if target.written is None:
                self.prefix_keys[rows, :, columns] = key_states
                self.prefix_values[rows, :, columns] = value_states
                return key_states, value_states
            keep = target.written[:, None, :, None]
            for store, new in ((self.prefix_keys, key_states), (self.prefix_values, value_states)):
                region = store[rows, :, columns]
                region.copy_(torch.where(keep, new, region))
            seen = slice(target.at - target.past, target.at + width)
            return self.prefix_keys[rows, :, seen], self.prefix_values[rows, :, seen]
        start, stop = self.length, self.length + key_states.shape[-2]
        active = cache.active_rows
        self.keys[:active, :, start:stop] = key_states
        self.values[:active, :, start:stop] = value_states
        self.length = stop
        return self.keys[:active, :, :stop], self.values[:active, :, :stop]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if self._cache.prefill_target is not None:
            return self._cache.prefill_target.past
        return self._cache.geometry.prefix_width + self.length

    def get_max_cache_shape(self) -> int:
        return self._cache.geometry.prefix_width + self._cache.geometry.capacity


class KVCache(Cache):
    """A ``transformers`` cache of a prefix store and a suffix store per layer (module doc).

    Use: ``with cache.prefill_groups(first, at): model(...)`` for each prefill microbatch (its
    batch item ``i`` is group ``first + i``; a prompt whose cached prefix :meth:`write_prefix`
    put in place prefills only its new tokens, attending to that prefix), then
    ``cache.start_decoding(column)``, then one model call per step, whose attention reads
    :meth:`prefix` for its layer; ``keep`` compacts.
    """

    def __init__(self, num_layers: int, geometry: Geometry, pool: KVBufferPool) -> None:
        self.geometry = geometry
        self.pool = pool
        self.active_rows = geometry.rows
        self.prefill_target: PrefillTarget | None = None
        super().__init__(layers=[_PreallocatedLayer(self, i) for i in range(num_layers)])

    def prefix(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s prefix keys and values (every group, every column)."""
        store = self.layers[layer]
        return store.prefix_keys, store.prefix_values

    @contextmanager
    def prefill_groups(
        self, first: int, at: int = 0, past: int = 0, written: torch.Tensor | None = None
    ):
        """Write the next forward's batch item ``i`` into group ``first + i``, from column ``at``.

        Without ``written`` the forward attends only to its own inputs (the cache reads as empty)
        and all of them are written. With ``written`` (``[groups, inputs]``, bool) the groups
        already hold a cached prefix of each prompt, ending where its new tokens start: the
        forward also attends to the ``past`` columns before ``at``, and only the inputs marked
        in ``written`` are kept, since an unmarked input is padding over a prefix's column.
        """
        if past and written is None:
            raise ValueError("a prefill that attends to past columns must say which inputs to keep")
        self.prefill_target = PrefillTarget(first, at, past, written)
        try:
            yield self
        finally:
            self.prefill_target = None

    def read_prefix(
        self, group: int, length: int, tail: tuple[int, int, int] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of every layer's keys and values of ``group``'s prompt (its last ``length``
        columns), each ``[kv_heads, columns, head_dim]``; with ``tail = (row, start, count)``,
        followed by ``row``'s suffix columns ``start .. start + count`` (a finished sequence:
        its prompt, then the completion tokens fed so far)."""
        start = self.geometry.prefix_width - length
        copies = []
        for layer in self.layers:
            keys, values = (
                layer.prefix_keys[group, :, start:],
                layer.prefix_values[group, :, start:],
            )
            if tail is None:
                copies.append((keys.clone(), values.clone()))
                continue
            row, first, count = tail
            columns = slice(first, first + count)
            copies.append(
                (
                    torch.cat([keys, layer.keys[row, :, columns]], dim=1),
                    torch.cat([values, layer.values[row, :, columns]], dim=1),
                )
            )
        return copies

    def write_prefix(
        self,
        group: int,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        length: int | None = None,
        before: int = 0,
    ) -> None:
        """Put a prompt's keys and values (as :meth:`read_prefix` gives them; their first
        ``length`` columns, default all) into ``group``, ending ``before`` columns left of its
        right edge (where that prompt's new tokens will be prefilled), zeros everywhere else. A
        layer no forward initialised yet takes its views now, its prefix store zeroed, so a
        prefill beside it leaves no column undefined."""
        for layer, (keys, values) in zip(self.layers, layers, strict=True):
            if not layer.is_initialized:
                layer.lazy_initialization(keys[None], values[None])
                layer.prefix_keys.zero_()
                layer.prefix_values.zero_()
            count = keys.shape[-2] if length is None else length
            end = self.geometry.prefix_width - before
            for store, data in ((layer.prefix_keys, keys), (layer.prefix_values, values)):
                store[group] = 0
                store[group, :, end - count : end] = data[:, :count]

    def start_decoding(self, column: int) -> None:
        """The next decode step writes every row's suffix at ``column``."""
        for layer in self.layers:
            layer.length = column

    def keep(self, rows: torch.Tensor, groups: torch.Tensor, prefix_width: int) -> None:
        """Keep only ``rows`` and ``groups`` (each ascending), moved to the front of the stores,
        and the last ``prefix_width`` prefix columns (the widest kept prompt's)."""
        old = self.geometry
        trim = old.prefix_width - prefix_width  # columns no kept prompt reaches
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            length = layer.length
            layer.keys[: len(rows), :, :length] = layer.keys[rows, :, :length]
            layer.values[: len(rows), :, :length] = layer.values[rows, :, :length]
            for name in ("prefix_keys", "prefix_values"):
                store = getattr(layer, name)
                store[: len(groups)] = store[groups]
                setattr(layer, name, store[: len(groups), :, trim:])
        self.active_rows = len(rows)
        self.geometry = Geometry(len(groups), prefix_width, len(rows), old.capacity)

    def relayout(
        self,
        geometry: Geometry,
        rows: tuple[torch.Tensor, int, int, int],
        groups: tuple[torch.Tensor, int],
    ) -> None:
        """Take ``geometry``. ``rows = (keep, lo, hi, end)``: row ``i < len(keep)`` then holds old
        row ``keep[i]``'s suffix columns ``lo .. hi`` ending at column ``end``, where the next
        write goes. ``groups = (keep, width)``: group ``i < len(keep)`` holds old group
        ``keep[i]``'s last ``width`` prefix columns, right-aligned. Every other column a row or
        group may read is zero (see the module doc). The buffers are reused when they are large
        enough; only the kept data is copied."""
        keep_rows, lo, hi, end = rows
        keep_groups, width = groups
        old = self.geometry
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            first = old.prefix_width - width
            kept = [
                layer.keys[:, :, lo:hi].index_select(0, keep_rows),
                layer.values[:, :, lo:hi].index_select(0, keep_rows),
                layer.prefix_keys[:, :, first:].index_select(0, keep_groups),
                layer.prefix_values[:, :, first:].index_select(0, keep_groups),
            ]
            layer.take_views(geometry)
            for store, data in zip((layer.keys, layer.values), kept[:2], strict=True):
                store[:, :, :end].zero_()
                store[: len(keep_rows), :, end - (hi - lo) : end] = data
            for store, data in zip((layer.prefix_keys, layer.prefix_values), kept[2:], strict=True):
                store.zero_()
                store[: len(keep_groups), :, geometry.prefix_width - width :] = data
            layer.length = end
        self.geometry = geometry
        self.active_rows = geometry.rows
