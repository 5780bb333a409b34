"""How many files the server process may hold open, raised at start to what the system allows.

Every connection is a file descriptor. One tenant may keep 1,024 long polls waiting
(``--max-long-polls-per-tenant``) and 4,096 OpenAI requests under way
(``--max-openai-requests-per-tenant``) besides its other requests, so under the soft limit many
systems start processes with (1,024) one tenant could exhaust it: ``accept`` then fails with
``EMFILE`` and the server takes no connection from anyone. The hard limit is what the operator
allows; the soft one is raised towards it (at most :data:`WANTED`), as vLLM's API server does.
Even at 65,536, about a dozen tenants at their limits fill it; a server for more lowers them.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)
WANTED = 65536


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
