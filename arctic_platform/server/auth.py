"""Bearer-token authentication and job ownership.

Tokens come from an environment variable (never from a file or the command line, so they do not
show up in ``ps`` or shell history); several comma-separated tokens give several tenants. A job
belongs to the token that created it, identified by a hash of the token, so tokens themselves are
never stored or logged. Comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from arctic_platform.server.errors import Unauthorized

PAT_TYPE_HEADER = "x-snowflake-authorization-token-type"
# The Tinker SDK sends its API key (one of the tokens) in this header.
API_KEY_HEADER = "x-api-key"
PAT_TYPE = "PROGRAMMATIC_ACCESS_TOKEN"


class TokenAuth:
    """Checks ``Authorization: Bearer <token>`` and returns the caller's owner id."""

    def __init__(self, tokens: list[str]) -> None:
        self._tokens = [t.encode() for t in tokens if t]

    @classmethod
    def from_env(cls, name: str | None, *, flag: str = "--token-env") -> TokenAuth:
        """Tokens from environment variable ``name`` (comma-separated); none if ``name`` is None.
        ``flag`` is the option that named the variable, for error messages."""
        if name is None:
            return cls([])
        value = os.environ.get(name)
        if not value:
            raise ValueError(f"{flag} {name}: the environment variable is unset or empty")
        tokens = [t.strip() for t in value.split(",") if t.strip()]
        if not tokens:
            # Only separators would otherwise mean "no tokens", i.e. no authentication at all.
            raise ValueError(f"{flag} {name}: the environment variable holds no token")
        return cls(tokens)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    @property
    def tenants(self) -> int:
        """How many tenants can call (1 without authentication)."""
        return max(1, len(set(self._tokens)))

    def holds(self, authorization: str | None) -> bool:
        """Whether these headers carry one of the tokens (never true when there are none)."""
        scheme, _, token = (authorization or "").partition(" ")
        if not self.enabled or scheme.lower() != "bearer":
            return False
        candidate = token.strip().encode()
        return any([hmac.compare_digest(candidate, known) for known in self._tokens])

    def owner(self, authorization: str | None, token_type: str | None = None) -> str | None:
        """The owner id for these headers; None when auth is off. Raises :class:`Unauthorized`."""
        if not self.enabled:
            return None
        if token_type is not None and token_type != PAT_TYPE:
            raise Unauthorized(f"unsupported token type {token_type!r}; expected {PAT_TYPE}")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
        candidate = token.strip().encode()
        matched = None
        for known in self._tokens:
            if hmac.compare_digest(candidate, known):
                matched = known
        if matched is None:
            raise Unauthorized("invalid token")
        return hashlib.sha256(matched).hexdigest()[:16]
