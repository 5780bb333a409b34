"""A preallocated key/value cache for batched decoding with transformers models.

``DynamicCache`` concatenates every layer's keys and values at every step, copying the whole cache
each time; ``StaticCache`` avoids the copy but makes attention read the full preallocated length.
This cache does neither: each layer owns buffers of ``[rows, kv_heads, capacity, head_dim]`` that
are written in place, and attention reads a view of the filled prefix only.

It adds what the sampler needs on top of a plain cache:

- **prefill into replicated rows**: a prompt shared by ``n`` samples is run through the model once
  and its keys/values are written into all ``n`` rows (``prefill_rows``), so nothing is recomputed;
- **compaction**: rows of finished sequences are dropped with one gather per layer (``keep_rows``),
  so later steps only compute the sequences still running;
- **joining**: sequences that join a running batch (:mod:`arctic_platform.engine.running_batch`)
  get new rows; ``relayout`` moves the rows still running into the new geometry (dropping the
  padding columns every one of them has, or left-padding them when a longer prompt joins) and
  the newcomers' prefill is written right-aligned at the common write index;
- **buffer reuse**: buffers come from a :class:`KVBufferPool`, which keeps them across batches and
  calls (no re-allocation per step or per call) until the sampler goes to sleep and releases them.

All sequences share one write index (the batch is left-padded to a common prompt width, with
per-row position ids and an attention mask), which is what keeps every step a single batched call.
Columns a row never wrote but attention reads (its left padding) hold zeros, never stale memory:
a masked position weighs exactly 0, and 0 times a stale NaN would still poison the row.
Only full-attention layers are supported (no sliding-window or linear-attention layers).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class KVBufferPool:
    """Keeps one flat buffer per (layer, keys|values) and hands out shaped views of it.

    A request for a shape that fits the buffer reuses it; a larger one replaces it. ``release``
    drops everything (the sampler's sleep), ``reserve`` re-creates the last sizes (its wake).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._last_sizes: dict[tuple[int, int], tuple[int, torch.dtype, torch.device]] = {}

    def view(
        self, key: tuple[int, int], shape: tuple[int, ...], dtype: torch.dtype, device
    ) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            self._buffers.pop(key, None)  # free the old one before allocating the new one
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        elif buffer.device != torch.device(device):
            buffer = self._buffers[key] = torch.empty(buffer.numel(), dtype=dtype, device=device)
        self._last_sizes[key] = (buffer.numel(), dtype, buffer.device)
        return buffer[:numel].view(shape)

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
    """One layer's keys and values; see :class:`KVCache`."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: KVCache, index: int) -> None:
        super().__init__()
        self._cache = cache
        self._index = index
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Head counts and sizes come from the first states seen, so any full-attention model works.
        cache = self._cache
        self.dtype, self.device = key_states.dtype, key_states.device
        heads = key_states.shape[1]
        k_shape = (cache.rows, heads, cache.capacity, key_states.shape[-1])
        v_shape = (cache.rows, heads, cache.capacity, value_states.shape[-1])
        self.keys = cache.pool.view((self._index, 0), k_shape, self.dtype, self.device)
        self.values = cache.pool.view((self._index, 1), v_shape, self.dtype, self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache = self._cache
        if cache.prefill_target is not None:
            rows, source, at = cache.prefill_target
            width = key_states.shape[-2]
            self.keys[rows, :, at : at + width] = key_states[source]
            self.values[rows, :, at : at + width] = value_states[source]
            return key_states, value_states
        start, stop = self.length, self.length + key_states.shape[-2]
        active = cache.active_rows
        self.keys[:active, :, start:stop] = key_states
        self.values[:active, :, start:stop] = value_states
        self.length = stop
        return self.keys[:active, :, :stop], self.values[:active, :, :stop]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self._cache.prefill_target is not None else self.length

    def get_max_cache_shape(self) -> int:
        return self._cache.capacity


class KVCache(Cache):
    """A ``transformers`` cache over preallocated buffers for ``rows`` sequences of ``capacity``.

    Use: ``with cache.prefill_rows(rows, source): model(...)`` for each prefill microbatch, then
    ``cache.start_decoding(prompt_width)``, then one model call per step; ``keep_rows(index)``
    compacts the batch to the given rows (in that order).
    """

    def __init__(self, num_layers: int, rows: int, capacity: int, pool: KVBufferPool) -> None:
        self.rows = rows
        self.capacity = capacity
        self.pool = pool
        self.active_rows = rows
        self.prefill_target: tuple[torch.Tensor, torch.Tensor, int] | None = None
        super().__init__(layers=[_PreallocatedLayer(self, i) for i in range(num_layers)])

    @contextmanager
    def prefill_rows(self, rows: torch.Tensor, source: torch.Tensor, at: int = 0):
        """Write the keys/values of the next forward's batch item ``source[i]`` into ``rows[i]``,
        from column ``at`` on.

        The forward attends only to its own inputs (the cache reads as empty during prefill).
        """
        self.prefill_target = (rows, source, at)
        try:
            yield self
        finally:
            self.prefill_target = None

    def start_decoding(self, prompt_width: int) -> None:
        """Every row now holds ``prompt_width`` positions; decode steps append after them."""
        for layer in self.layers:
            layer.length = prompt_width

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index`` (ascending), moved to the front of the buffers."""
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            length = layer.length
            layer.keys[: len(index), :, :length] = layer.keys[index, :, :length]
            layer.values[: len(index), :, :length] = layer.values[index, :, :length]
        self.active_rows = len(index)

    def relayout(
        self, keep: torch.Tensor, columns: tuple[int, int], rows: int, capacity: int, end: int
    ) -> None:
        """Take the geometry ``rows x capacity``: row ``i < len(keep)`` then holds old row
        ``keep[i]``'s columns ``columns = (lo, hi)`` ending at column ``end``, the next write goes
        to ``end``, and every other position before ``end`` is zero (see the module doc).
        The buffers are reused when they are large enough; only the kept data is copied."""
        lo, hi = columns
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            kept = [t[:, :, lo:hi].index_select(0, keep) for t in (layer.keys, layer.values)]
            for kind, data in enumerate(kept):
                shape = (rows, data.shape[1], capacity, data.shape[3])
                view = self.pool.view((layer._index, kind), shape, layer.dtype, layer.device)
                view[:, :, :end].zero_()
                view[: len(keep), :, end - (hi - lo) : end] = data
                if kind == 0:
                    layer.keys = view
                else:
                    layer.values = view
            layer.length = end
        self.rows = self.active_rows = rows
        self.capacity = capacity
