"""Configuration files in YAML (client configs, recipes): read as one mapping, bounded in size,
every error a ``ValueError`` naming the file.

YAML aliases let a file of a few hundred bytes stand for billions of values (each anchor a list
of references to the one before): the parsed document shares them, but anything that walks it
(validation, a dump of the run's config) expands them and runs out of memory. So a document is
refused once a walk of it meets more than :data:`MAX_YAML_VALUES` values, counted as a walk
meets them (an alias each time it is used).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Values a configuration file may hold, aliases expanded: real ones hold hundreds.
MAX_YAML_VALUES = 100_000


def load_mapping(path: str | os.PathLike, *, what: str = "--config") -> dict[str, Any]:
    """The mapping at the top of the YAML file ``path`` (an empty file is ``{}``); ``what``
    names where the path came from in the error for a missing file."""
    import yaml

    source = Path(path)
    if not source.is_file():
        raise ValueError(f"{what}: {source} does not exist (or is not a file)")
    try:
        text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"{source}: expected a mapping at the top level, got {type(data).__name__}"
        )
    check_size(data, source)
    return data


def check_size(data: Any, source: str | os.PathLike) -> None:
    """A ``ValueError`` once a walk of ``data`` meets more than :data:`MAX_YAML_VALUES` values
    (iterative: a deep document cannot exhaust the stack either)."""
    stack, seen = [data], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > MAX_YAML_VALUES:
            raise ValueError(
                f"{source}: holds more than {MAX_YAML_VALUES} values once its aliases are "
                "expanded; a configuration needs far fewer"
            )
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
