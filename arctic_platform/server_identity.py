"""How a client recognises ``arctic-platform serve``: the identity ``GET /health`` answers.

``/health`` answers ``{"status": "OK", "server": "arctic-platform", "version": ..., "instance":
...}``. ``instance`` is unique per server process (a launcher chooses it, so it can tell the
server it started from anything else that answers on the port). A client refuses to work with a
process whose answer lacks the ``server`` name: another program that happens to answer 200 on
that port is not a server it can trust with a training job. Needs only the standard library.
"""

from __future__ import annotations

import uuid
from typing import Any

from arctic_platform import __version__

SERVER_NAME = "arctic-platform"
# The path prefixes a server launched by its one user's own driver (``launch_local_server``, the
# ray backend's state actor) lets clients read and save under: it runs as that user, for that
# driver, so a framework's absolute checkpoint folder means what it says (server/paths.py).
OWN_USER_PREFIXES = ("/",)


def new_instance_id() -> str:
    """A fresh id for one server process."""
    return uuid.uuid4().hex


def health_answer(instance: str) -> dict[str, str]:
    """The body of ``GET /health`` for the server process ``instance``."""
    return {"status": "OK", "server": SERVER_NAME, "version": __version__, "instance": instance}


def identity_problem(answer: Any, *, instance: str | None = None) -> str | None:
    """Why ``answer`` (a parsed ``/health`` body) is not our server (or not ``instance``), or
    None when it is."""
    if not isinstance(answer, dict) or answer.get("server") != SERVER_NAME:
        return f"it is not arctic-platform serve (/health answered {str(answer)[:120]!r})"
    if instance is not None and answer.get("instance") != instance:
        return (
            f"it is another arctic-platform server (instance {answer.get('instance')!r}, "
            f"not the {instance!r} this client launched)"
        )
    return None
