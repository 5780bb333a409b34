"""Signed download links for checkpoint files (``get_external_weights_urls``).

The SDK's download path fetches each file with a plain GET and no credentials, as from a cloud
bucket's signed URL. Here a link names one file of one checkpoint and an expiry time, signed
with HMAC-SHA256 under a key the server draws at start; the link is the capability, so it stops
working when it expires or the server restarts.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time

from arctic_platform.server.errors import NotFound

LINK_LIFETIME_S = 3600


class DownloadSigner:
    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def sign(self, file_id: list, *, now: float | None = None) -> tuple[str, float]:
        """A token for ``file_id`` (``[owner, tinker path, relative file path]``) and its expiry."""
        expires = (time.time() if now is None else now) + LINK_LIFETIME_S
        payload = base64.urlsafe_b64encode(json.dumps([file_id, expires]).encode()).decode()
        return f"{payload}.{self._mac(payload)}", expires

    def verify(self, token: str) -> list:
        """The ``file_id`` a valid, unexpired token names; 404 otherwise (no oracle for guesses)."""
        payload, _, mac = token.partition(".")
        if not hmac.compare_digest(mac, self._mac(payload)):
            raise NotFound("download link not found")
        file_id, expires = json.loads(base64.urlsafe_b64decode(payload))
        if time.time() > expires:
            raise NotFound("download link expired")
        return file_id

    def _mac(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()
