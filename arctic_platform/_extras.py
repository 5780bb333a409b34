"""Turn a missing optional dependency into an error that names the extra to install.

The package is split into extras (``client``, ``engine``, ``server``, ``ray``, ``verl``) so a driver
that only talks to a remote server never pulls in torch. Modules that need a heavy dependency import
it through :func:`require` so the user sees ``pip install 'arctic-platform[engine]'`` instead of a
bare ``ModuleNotFoundError`` from deep inside the stack.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def require(module: str, extra: str, *, purpose: str | None = None) -> ModuleType:
    """Import ``module`` or raise an ImportError that names the ``extra`` providing it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise _missing(module, extra, purpose) from exc


def require_installed(module: str, extra: str, *, purpose: str | None = None) -> None:
    """Check that ``module`` is installed without importing it (torch takes seconds to import,
    and a command that is only checking its flags should answer at once); the same error as
    :func:`require` when it is not."""
    if importlib.util.find_spec(module) is None:
        raise _missing(module, extra, purpose)


def _missing(module: str, extra: str, purpose: str | None) -> ImportError:
    what = f" for {purpose}" if purpose else ""
    return ImportError(
        f"{module!r} is needed{what} but is not installed; "
        f"install it with: pip install 'arctic-platform[{extra}]'"
    )
