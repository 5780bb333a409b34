"""Prefilled prompts kept across ``generate`` calls, so a prompt seen again is not prefilled again.

RL callers send the same prompt many times: SkyRL repeats each prompt ``n`` times in one call,
verl's agent loop sends each sample as its own request, a multi-sample Tinker ``sample`` may be
split across calls, and an evaluation re-sends its prompts every round. The running batch already
prefills a prompt once per admission (:mod:`.running_batch`); this cache keeps, for the prompts it
prefilled, every layer's keys and values and the logits of the first sampled token, so a later
admission of the same token ids copies them into its prefix store instead of running the model.
This is vLLM's automatic prefix caching, for whole prompts.

It is exact-match on the token ids and holds at most ``max_bytes``, and at most the room the
running batch's cache leaves of the sampler's KV budget (:meth:`PromptCache.make_room`). The
batch comes first: its buffers are kept at their largest, for reuse, and entries leave before
they grow, so cached prompts never take memory the sampler was not allowed; after a call whose
batch filled ``max_kv_cache_bytes`` the cache has no room (a larger budget gives room to both).
Least recently used entries leave first; a prompt whose entry would not fit is not copied at
all; ``max_bytes = 0`` turns the cache off. Entries are only valid for the weights they were
computed with. The sampler clears the cache on every weight load (every path that changes its
weights goes through one), sleep and ``reset_prefix_cache``; as a second guard the cache notes
each parameter's identity, storage, device and version counter when it stores and drops
everything when one changed, which catches a parameter replaced or moved and an in-place edit
through torch ops (not a write through ``.data``, which skips the version counter). A model
holding inference tensors (which have no version counter) is never cached.

The keys and values a hit copies were computed in an earlier prefill, maybe padded beside other
prompts, so they equal a fresh prefill's to float rounding, as a prompt prefilled beside
different prompts does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CachedPrompt:
    """One prompt's per-layer ``(keys, values)``, each ``[kv_heads, len, head_dim]``, and the
    float32 logits ``[vocab]`` of the token after it."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    logits: torch.Tensor

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in self.layers for t in pair] + [self.logits]
        return sum(t.numel() * t.element_size() for t in tensors)


class PromptCache:
    """Least-recently-used prefilled prompts of one model, within ``max_bytes`` (module doc)."""

    def __init__(self, model: torch.nn.Module, max_bytes: int, room: int) -> None:
        self.model = model
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], CachedPrompt] = OrderedDict()
        self._weights: tuple | None = None
        self._room = room  # what the running batch leaves of the KV budget (make_room)
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def lookup(self, prompts: Sequence[Sequence[int]]) -> list[CachedPrompt | None]:
        """Each prompt's entry, or None; counts hits and misses."""
        if not self.enabled:
            return [None] * len(prompts)
        if self._entries and self._weights != _weights_state(self.model):
            self.clear()
        found = []
        for prompt in prompts:
            key = tuple(prompt)
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
            else:
                self._entries.move_to_end(key)
                self.hits += 1
                self.hit_tokens += len(key)
            found.append(entry)
        return found

    @property
    def budget(self) -> int:
        """The bytes the cache may hold now: ``max_bytes``, within the batch's leftover room."""
        return max(0, min(self.max_bytes, self._room))

    def make_room(self, room: int) -> None:
        """The running batch leaves ``room`` bytes of the KV budget: evict down to it."""
        self._room = room
        self._evict(0)

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` could be kept (check before copying one)."""
        return 0 < nbytes <= self.budget

    def store(self, entries: Iterable[tuple[Sequence[int], CachedPrompt]]) -> None:
        """Keep each ``(prompt, entry)``, computed with the model's current weights. ``entries``
        is consumed one at a time, after the weights were noted once, and least recently used
        ones leave as each arrives, so a lazy iterable never holds more than the budget plus one
        entry; nothing of it is consumed when the weights cannot be noted."""
        weights = _weights_state(self.model)
        if weights is None:
            return
        if self._weights != weights:
            self.clear()
            self._weights = weights
        for prompt, entry in entries:
            self._keep(tuple(prompt), entry)

    def _keep(self, key: tuple[int, ...], entry: CachedPrompt) -> None:
        size = entry.nbytes
        if size > self.budget:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._evict(size)
        self._entries[key] = entry
        self.nbytes += size

    def _evict(self, incoming: int) -> None:
        """Drop least recently used entries until ``incoming`` more bytes fit the budget."""
        while self._entries and self.nbytes + incoming > self.budget:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def clear(self) -> dict:
        """Drop every entry; how many and their bytes."""
        dropped = {"cached_prefixes": len(self._entries), "bytes_released": self.nbytes}
        self._entries.clear()
        self._weights = None
        self.nbytes = 0
        return dropped

    def state(self) -> dict:
        """Entries, bytes and budget, and the hits and misses so far (prompts, not samples)."""
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "budget": self.budget,
            "hits": self.hits,
            "misses": self.misses,
            "hit_tokens": self.hit_tokens,
        }


def _weights_state(model: torch.nn.Module) -> tuple | None:
    """Every parameter's identity, storage, device and version counter; None when one has no
    version counter."""
    state = []
    for param in model.parameters():
        if param.is_inference():
            return None
        state.append((id(param), param.data_ptr(), param.device, param._version))
    return tuple(state)
