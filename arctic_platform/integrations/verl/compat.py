"""Which verl the integration needs, and the error that says so when the installed one is older.

The plugin registers itself with ``verl.remote_backend`` (the ``RemoteBackend`` ABC and its
registry), which verl-project/verl PR #6422 adds and PR #7102 ports to verl's V1 trainer. No verl
release on PyPI has it yet (0.9.1 does not), so importing the integration against such a verl must
fail with an error that names what to install instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from arctic_platform._extras import require

REMOTE_BACKEND_MODULE = "verl.remote_backend"


def missing_remote_backend_message(version: str) -> str:
    return (
        f"arctic_platform.integrations.verl needs {REMOTE_BACKEND_MODULE} (verl's RemoteBackend "
        f"API), which the installed verl {version} does not have. It comes with "
        "verl-project/verl PR #6422 (the generic remote backend) and PR #7102 (its port to the V1 "
        f"trainer): install a verl release with {REMOTE_BACKEND_MODULE}, or verl from that branch "
        "(pip install 'git+https://github.com/verl-project/verl@refs/pull/7102/head')"
    )


def remote_backend_api() -> ModuleType:
    """``verl.remote_backend``, or an ImportError naming the verl that provides it."""
    verl = require("verl", "verl", purpose="the verl integration")
    try:
        return importlib.import_module(REMOTE_BACKEND_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != REMOTE_BACKEND_MODULE:
            raise
        version = getattr(verl, "__version__", "(unknown version)")
        raise ImportError(missing_remote_backend_message(version)) from None
