"""The tags of ``wake_inference``: what a sleeping sampling engine can be asked to restore.

Both sampling engines (ours and vLLM's) take the same ``tags`` with the same errors, like vLLM's
``wake_up(tags=...)``: ``weights`` and ``kv_cache``, all of them when none are given.
"""

from __future__ import annotations

from collections.abc import Sequence

from arctic_platform.engine.errors import EngineInputError

SLEEP_TAGS = ("weights", "kv_cache")


def checked_wake_tags(tags: Sequence[str] | None) -> list[str]:
    """``tags`` as a list (all tags for ``None``); raises :class:`EngineInputError` on bad ones."""
    if tags is None:
        return list(SLEEP_TAGS)
    if isinstance(tags, str) or not isinstance(tags, Sequence):
        raise EngineInputError("tags", f"expected a list of tags from {list(SLEEP_TAGS)}")
    unknown = [t for t in tags if t not in SLEEP_TAGS]
    if unknown:
        raise EngineInputError("tags", f"unknown tag(s) {unknown}; known: {list(SLEEP_TAGS)}")
    return list(tags)
