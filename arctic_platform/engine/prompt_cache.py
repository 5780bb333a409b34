"""Prefilled prompts kept across ``generate`` calls, so a prompt seen again is not prefilled again
and one that starts like a cached prompt is prefilled only from where they part.

RL callers send the same prompt many times: SkyRL repeats each prompt ``n`` times in one call,
verl's agent loop sends each sample as its own request, a multi-sample Tinker ``sample`` may be
split across calls, and an evaluation re-sends its prompts every round. A multi-turn rollout sends
each turn's prompt again with the completion and the next observation appended. The running batch
already prefills a prompt once per admission (:mod:`.running_batch`); this cache keeps, for the
prompts it prefilled, every layer's keys and values and the logits of the first sampled token. A
later admission of the same token ids copies them into its prefix store instead of running the
model (a hit); one whose first tokens are the first tokens of a cached prompt copies the keys and
values of those and runs the model only on the rest, attending to them (a prefix hit). A call whose
prompt extends a whole cached one (a next turn) also has its finished sequences kept, each as its
prompt and its tokens but the last, so the turn after prefills only its new observation.
Single-turn work extends nothing and pays no copy. This is vLLM's automatic prefix caching, except
that vLLM keeps every completion's blocks from the first turn on, and that a prompt sharing its
start with a cached one is kept whole beside it (vLLM's blocks are shared).

Prefix hits are found a block of :data:`BLOCK` tokens at a time: every entry is indexed by the
chained hash of each run of whole blocks it starts with, so a lookup hashes the prompt's blocks
until one is not indexed, checks the tokens of the entries found (a hash proves nothing), and
then extends the match token by token into the next block. A match is at least one block and at
most all but the prompt's last token, whose forward gives the first step's logits.

The cache holds at most ``max_bytes``, and at most the room the running batch's cache leaves of the
sampler's KV budget (:meth:`PromptCache.make_room`). The batch comes first: its buffers are kept at
their largest, for reuse, and entries leave before they grow, so cached prompts never take memory
the sampler was not allowed; after a call whose batch filled ``max_kv_cache_bytes`` the cache has
no room (a larger budget gives room to both). Least recently used entries leave first; a prompt
whose entry would not fit is not copied at all; ``max_bytes = 0`` turns the cache off. Entries are
only valid for the weights they were computed with. The sampler clears the cache on every weight
load (every path that changes its weights goes through one), sleep and ``reset_prefix_cache``; as a
second guard the cache notes each parameter's identity, storage, device and version counter when it
stores and drops everything when one changed, which catches a parameter replaced or moved and an
in-place edit through torch ops (not a write through ``.data``, which skips the version counter). A
model holding inference tensors (which have no version counter) is never cached.

The keys and values a hit copies were computed in an earlier prefill, maybe padded beside other
prompts, so they equal a fresh prefill's to float rounding, as a prompt prefilled beside
different prompts does; the same holds for a prefix hit's (causal attention: a token's keys and
values depend only on the tokens before it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# Prefix matches are found a block of this many tokens at a time (vLLM's block size on CPU is 16
# too): each entry is indexed by the chained hash of every whole block it starts with.
BLOCK = 16


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


@dataclass(frozen=True)
class Match:
    """What the cache holds of one prompt: the first ``length`` tokens of ``entry`` (a cached
    prompt that starts like it). ``complete``: the entry is this very prompt, logits included;
    otherwise the tokens after ``length`` (at least one) must still be prefilled. ``extends``:
    the whole entry starts the prompt, as a multi-turn rollout's next turn starts with its last
    one (a shared system prompt matches only part of an entry)."""

    entry: CachedPrompt
    length: int
    complete: bool
    extends: bool = False


class PromptCache:
    """Least-recently-used prefilled prompts of one model, within ``max_bytes`` (module doc)."""

    def __init__(self, model: torch.nn.Module, max_bytes: int, room: int) -> None:
        self.model = model
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], CachedPrompt] = OrderedDict()
        # chained hash of a run of whole blocks -> the entries that start with that run
        self._blocks: dict[int, dict[tuple[int, ...], None]] = {}
        self._weights: tuple | None = None
        self._room = room  # what the running batch leaves of the KV budget (make_room)
        self.nbytes = 0
        self.hits = 0
        self.prefix_hits = 0
        self.misses = 0
        self.hit_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def lookup(self, prompts: Sequence[Sequence[int]]) -> list[Match | None]:
        """Each prompt's match, or None: the prompt itself when it is cached, else the longest
        run of its first tokens (one block at least, all but its last token at most) that a
        cached prompt starts with. Counts hits, prefix hits and misses."""
        if not self.enabled:
            return [None] * len(prompts)
        if self._entries and self._weights != _weights_state(self.model):
            self.clear()
        found = []
        for prompt in prompts:
            key = tuple(prompt)
            entry = self._entries.get(key)
            if entry is not None:
                source, match = key, Match(entry, len(key), True)
            else:
                source, match = self._prefix(key)
            if match is None:
                self.misses += 1
            else:
                self._entries.move_to_end(source)
                self.hits += match.complete
                self.prefix_hits += not match.complete
                self.hit_tokens += match.length
            found.append(match)
        return found

    def _prefix(self, key: tuple[int, ...]) -> tuple[tuple[int, ...] | None, Match | None]:
        """The longest cached start of ``key`` that leaves at least its last token to prefill,
        and the key of the entry it comes from."""
        usable = len(key) - 1
        if not self._blocks or usable < BLOCK:
            return None, None
        chain = _chain(key, usable // BLOCK)
        blocks = 0
        while blocks < len(chain) and chain[blocks] in self._blocks:
            blocks += 1
        for count in range(blocks, 0, -1):  # a longer run whose hash matched but tokens do not
            shared = count * BLOCK
            # Rank the entries of the run by how far they go on matching (a few tokens each:
            # past the run they differ within a block), then check the run's tokens of the best
            # only, so a lookup costs one comparison of the shared start, however many cached
            # prompts start with it (a long system prompt).
            ranked = []
            for source in self._blocks[chain[count - 1]]:
                n, limit = shared, min(len(source), usable)
                while n < limit and source[n] == key[n]:
                    n += 1
                ranked.append((n, n == len(source), source))
            ranked.sort(key=lambda match: match[:2], reverse=True)  # a whole entry wins a tie
            for n, whole, source in ranked:
                if source[:shared] == key[:shared]:  # else a hash collision
                    return source, Match(self._entries[source], n, False, whole)
        return None, None

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
        if key in self._entries:
            self._drop(key)
        self._evict(size)
        self._entries[key] = entry
        self.nbytes += size
        for block in _chain(key, len(key) // BLOCK):
            self._blocks.setdefault(block, {})[key] = None

    def _evict(self, incoming: int) -> None:
        """Drop least recently used entries until ``incoming`` more bytes fit the budget."""
        while self._entries and self.nbytes + incoming > self.budget:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
        for block in _chain(key, len(key) // BLOCK):
            holders = self._blocks[block]
            del holders[key]
            if not holders:
                del self._blocks[block]

    def clear(self) -> dict:
        """Drop every entry; how many and their bytes."""
        dropped = {"cached_prefixes": len(self._entries), "bytes_released": self.nbytes}
        self._entries.clear()
        self._blocks.clear()
        self._weights = None
        self.nbytes = 0
        return dropped

    def state(self) -> dict:
        """Entries, bytes and budget, and the hits, prefix hits and misses so far (prompts, not
        samples) with the tokens they took from the cache instead of a prefill."""
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "budget": self.budget,
            "hits": self.hits,
            "prefix_hits": self.prefix_hits,
            "misses": self.misses,
            "hit_tokens": self.hit_tokens,
        }


def _chain(tokens: tuple[int, ...], blocks: int) -> list[int]:
    """The chained hash of ``tokens``' first 1, 2, .. ``blocks`` whole blocks."""
    hashes, previous = [], 0
    for start in range(0, blocks * BLOCK, BLOCK):
        previous = hash((previous, tokens[start : start + BLOCK]))
        hashes.append(previous)
    return hashes


def _weights_state(model: torch.nn.Module) -> tuple | None:
    """Every parameter's identity, storage, device and version counter; None when one has no
    version counter."""
    state = []
    for param in model.parameters():
        if param.is_inference():
            return None
        state.append((id(param), param.data_ptr(), param.device, param._version))
    return tuple(state)
