"""Signed links: download URLs that are their own credential, for every API that hands them out
(Cortex ``checkpoints/{id}:export``, Tinker ``get_external_weights_urls``).

Clients fetch such a file with a plain GET and no credentials, as from a cloud bucket's signed URL.
A link's token names what it opens (a list: the API's own names for one file) and an expiry
time, signed with HMAC-SHA256 under a key the server draws at start; so a link stops working when
it expires or the server restarts, and a changed or guessed token opens nothing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time

from arctic_platform.server.errors import NotFound


class LinkSigner:
    """Signs and checks link tokens with the server's key (one per Service)."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def sign(self, subject: list, *, expires: float) -> str:
        """A URL-safe token for ``subject`` that opens it until ``expires`` (a Unix time; one
        answer's links share theirs)."""
        payload = base64.urlsafe_b64encode(json.dumps([subject, expires]).encode()).decode()
        return f"{payload}.{self._mac(payload)}"

    def verify(self, token: str) -> list:
        """The subject a valid, unexpired token names; 404 otherwise (no oracle for guesses)."""
        payload, _, mac = token.partition(".")
        # compare_digest takes only ASCII text: anything else is no token of ours.
        if not token.isascii() or not hmac.compare_digest(mac, self._mac(payload)):
            raise NotFound("download link not found")
        subject, expires = json.loads(base64.urlsafe_b64decode(payload))
        if time.time() > expires:
            raise NotFound("download link expired; ask for a new one", code="expired")
        return subject

    def _mac(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()
