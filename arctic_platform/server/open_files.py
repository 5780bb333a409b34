"""How many files the server process may hold open, raised at start to what the system allows.

Every connection is a file descriptor. One tenant may keep 1,024 long polls waiting
(``--max-long-polls-per-tenant``) and 4,096 OpenAI requests under way
(``--max-openai-requests-per-tenant``) besides its other requests, so under the soft limit many
systems start processes with (1,024) one tenant could exhaust it: ``accept`` then fails with
``EMFILE`` and the server takes no connection from anyone. The hard limit is what the operator
allows; the soft one is raised towards it (at most :data:`WANTED`), as vLLM's API server does.
Even at 65,536, about a dozen tenants at their limits fill it, so the connections taken at once
are bounded too (:func:`connection_limit`): beyond it uvicorn answers 503 at once, and the
server keeps the files its own work needs.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)
WANTED = 65536
# Files the server keeps for everything but connections: its store, model and checkpoint files,
# engine processes' pipes, Ray's sockets.
RESERVED = 1024
# Connections served at least, however low the limit (a server that takes none is no server).
MIN_CONNECTIONS = 64


def raise_open_files_limit(wanted: int = WANTED) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to ``wanted``, or to the hard limit when that is lower;
    returns the soft limit in force. A system that refuses keeps its limit, with a warning."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        log.warning("open files stay limited to %d (raising to %d failed: %s)", soft, target, exc)
        return soft
    log.info("open files limit raised from %d to %d", soft, target)
    return target


def connection_limit(open_files: int) -> int | None:
    """Connections (or requests in progress) to take at once under ``open_files``: uvicorn's
    ``limit_concurrency``, beyond which it answers 503 at once, so a flood of connections cannot
    use up the files the server needs for its own work (None: no limit to keep within)."""
    if open_files == resource.RLIM_INFINITY:
        return None
    return max(MIN_CONNECTIONS, open_files - RESERVED)
