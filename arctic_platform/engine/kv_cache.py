"""A key/value cache of sequence *slots* for continuous batching with transformers models.

``DynamicCache`` concatenates every layer's keys and values at every step, copying the whole cache
each time; ``StaticCache`` makes attention read the full preallocated length. This cache does
neither: each layer owns one buffer of ``[slots, kv_heads, capacity, head_dim]`` written in place,
and attention reads the rows in use up to the longest sequence only.

Each running sequence owns a row (a slot) and its own length: its prompt sits at positions
``0 .. P-1`` and each decode step writes at the row's own next position. So sequences of any
prompt length join and leave between steps without moving the others:

- **join** (``prefill_rows``): a prompt is run through the model once (left-padded with the other
  prompts of its microbatch) and its keys/values are written into the rows of all its ``n``
  samples, shifted to start at position 0;
- **leave** (``remove_rows``): the rows of finished sequences are filled by the last rows in use,
  so the rows in use stay ``0 .. active-1`` and each step computes only running sequences, at the
  cost of copying one row per finished sequence;
- **reuse**: the buffers stay allocated across sequences and calls; they grow (keeping the rows in
  use) only when a joining sequence needs more rows or positions than they hold, and are released
  only by the sampler's sleep (``release`` / ``reserve``).

Attention reads ``[:active, :, :longest]``: when all rows have the same length (the ``n`` samples
of one prompt, or equal-length prompts that joined together) no mask is needed; otherwise the
sampler passes a mask hiding each row's positions past its own length. Only full-attention layers
are supported (no sliding-window or linear-attention layers).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from arctic_platform.engine.kv_shape import KVShape

# Allocation granularity when the buffers must grow, so that a stream of slightly longer requests
# does not reallocate at every join.
_ROW_STEP = 8
_POSITION_STEP = 64


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values; see :class:`KVCache`."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: KVCache) -> None:
        super().__init__()
        self._cache = cache
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers are preallocated
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        cache = self._cache
        if cache.prefill_target is not None:
            for rows, source, start, stop in cache.prefill_target:
                self.keys[rows, :, : stop - start] = key_states[source, :, start:stop]
                self.values[rows, :, : stop - start] = value_states[source, :, start:stop]
            return key_states, value_states
        active, longest = cache.active, cache.longest
        if cache.uniform:
            self.keys[:active, :, longest : longest + 1] = key_states
            self.values[:active, :, longest : longest + 1] = value_states
        else:
            rows = cache.row_index[:active]
            self.keys[rows, :, cache.lengths] = key_states[:, :, 0]
            self.values[rows, :, cache.lengths] = value_states[:, :, 0]
        return self.keys[:active, :, : longest + 1], self.values[:active, :, : longest + 1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self._cache.prefill_target is not None else self._cache.longest

    def get_max_cache_shape(self) -> int:
        return self._cache.capacity


class KVCache(Cache):
    """A ``transformers`` cache over ``slots x capacity`` positions per layer (module doc).

    The sampler drives it: ``ensure`` room, ``with prefill_rows(...)`` for each prefill
    microbatch, ``joined(rows, lengths)``, then per step one model call followed by ``advance()``;
    ``remove_rows`` when sequences finish. ``lengths[i]`` is how many positions row ``i`` holds.
    """

    def __init__(self, shape: KVShape, device: torch.device) -> None:
        self.shape = shape
        self.device = device
        self.slots = 0
        self.capacity = 0
        self.active = 0
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)
        self.longest = 0
        self.uniform = True
        self.row_index = torch.zeros(0, dtype=torch.long, device=device)
        self.prefill_target: list[tuple[torch.Tensor, torch.Tensor, int, int]] | None = None
        self._released_size: tuple[int, int] | None = None
        super().__init__(layers=[_SlotLayer(self) for _ in range(shape.layers)])
        self._allocate(0, 0)

    # -- memory ---------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values (held until ``release``)."""
        return self.slots * self.capacity * self.shape.bytes_per_token

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the positions the running sequences hold."""
        return int(self.lengths.sum()) * self.shape.bytes_per_token

    def fits(self, rows: int, positions: int, budget: int) -> bool:
        """Whether ``rows`` sequences of up to ``positions`` positions fit ``budget`` bytes."""
        return rows * max(positions, self.needed_positions()) * self.shape.bytes_per_token <= budget

    def needed_positions(self) -> int:
        return self._needed_positions

    def ensure(self, rows: int, positions: int, budget: int, max_rows: int) -> None:
        """Make room for ``rows`` sequences of ``positions`` positions each, keeping the rows in
        use; grows by steps (module doc) within ``budget`` bytes and ``max_rows``."""
        self._needed_positions = max(self._needed_positions, positions)
        positions = self._needed_positions
        if rows <= self.slots and positions <= self.capacity:
            return
        per_token = self.shape.bytes_per_token
        capacity = max(self.capacity, _round_up(positions, _POSITION_STEP))
        if rows * capacity * per_token > budget:
            capacity = max(self.capacity, positions)
        if rows * capacity * per_token > budget:  # the old capacity itself is too long: shrink
            capacity = positions
        by_budget = budget // (capacity * per_token)
        slots = max(rows, min(_round_up(rows, _ROW_STEP), max_rows, by_budget))
        self._allocate(slots, capacity)

    def release(self) -> int:
        """Drop the buffers (the sampler's sleep; nothing may be running); return bytes freed."""
        freed = self.nbytes
        if freed:
            self._released_size = (self.slots, self.capacity)
            self._allocate(0, 0)
        return freed

    def reserve(self) -> int:
        """Allocate again the buffers ``release`` dropped; return the bytes allocated."""
        if self._released_size is not None:
            self._allocate(*self._released_size)
            self._released_size = None
        return self.nbytes

    def _allocate(self, slots: int, capacity: int) -> None:
        shape = self.shape
        size = (slots, shape.heads, capacity, shape.head_dim)
        keep, length = self.active, self.longest
        for layer in self.layers:
            old = (getattr(layer, "keys", None), getattr(layer, "values", None))
            layer.keys = layer.values = None  # free the old buffers before the new ones exist
            new = []
            for tensor in old:
                fresh = torch.empty(size, dtype=shape.dtype, device=self.device)
                if keep and tensor is not None:
                    fresh[:keep, :, :length] = tensor[:keep, :, :length]
                new.append(fresh)
            layer.keys, layer.values = new
        self.slots, self.capacity = slots, capacity
        self.row_index = torch.arange(slots, device=self.device)
        if not keep:
            self._needed_positions = 0

    # -- sequences --------------------------------------------------------------------------------

    @contextmanager
    def prefill_rows(self, rows: torch.Tensor, source: torch.Tensor, lengths: list[int], width):
        """Write the next forward's keys/values of batch item ``source[i]`` (a prompt of
        ``lengths[i]`` tokens, left-padded to ``width``) into positions ``0 ..`` of ``rows[i]``.

        The forward attends only to its own inputs (the cache reads as empty meanwhile)."""
        groups = []
        lengths_t = torch.tensor(lengths)
        for length in sorted(set(lengths)):
            pick = (lengths_t == length).nonzero().squeeze(1).to(rows.device)
            groups.append((rows[pick], source[pick], width - length, width))
        self.prefill_target = groups
        try:
            yield self
        finally:
            self.prefill_target = None

    def joined(self, lengths: torch.Tensor) -> None:
        """Rows ``active ..`` now hold sequences of ``lengths`` positions (just prefilled)."""
        self.active += len(lengths)
        self.lengths = torch.cat([self.lengths, lengths.to(self.device)])
        self._settle()

    def advance(self) -> None:
        """Every running row gained the position the last decode step wrote."""
        self.lengths += 1
        self.longest += 1

    def remove_rows(self, finished: list[int]) -> list[int]:
        """Free the rows ``finished``: the last rows in use move into their places.

        Returns the new order as indices of the old rows (``order[i]`` is the old row now at
        ``i``), for the caller's per-row state."""
        gone = set(finished)
        survivors = self.active - len(gone)
        order = list(range(survivors))
        holes = [r for r in range(survivors) if r in gone]
        movers = [r for r in range(survivors, self.active) if r not in gone]
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            length = self.longest
            for layer in self.layers:
                layer.keys[dst, :, :length] = layer.keys[src, :, :length]
                layer.values[dst, :, :length] = layer.values[src, :, :length]
        self.active = survivors
        self.lengths = self.lengths[torch.tensor(order, dtype=torch.long, device=self.device)]
        self._settle()
        return order

    def attention_mask(self) -> torch.Tensor | None:
        """The decode step's mask over ``longest + 1`` positions, or None when every row has the
        same length (nothing to hide)."""
        if self.uniform:
            return None
        positions = torch.arange(self.longest + 1, device=self.device)
        return positions[None, :] <= self.lengths[:, None]

    def _settle(self) -> None:
        if self.active:
            low, high = int(self.lengths.min()), int(self.lengths.max())
        else:
            low = high = 0
            self._needed_positions = 0
        self.longest, self.uniform = high, low == high


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step
