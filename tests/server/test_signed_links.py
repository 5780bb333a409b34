"""The server's signed links (Cortex exports, Tinker weight downloads): a token opens what it
names until it expires, under this server's key only."""

from __future__ import annotations

import time

import pytest

from arctic_platform.server.errors import NotFound
from arctic_platform.server.signed_links import LinkSigner


def test_a_token_opens_its_subject_until_it_expires():
    signer = LinkSigner()
    token = signer.sign(["job", "ckpt", "model.safetensors"], expires=time.time() + 60)
    assert signer.verify(token) == ["job", "ckpt", "model.safetensors"]
    expired = signer.sign(["job", "ckpt", "model.safetensors"], expires=time.time() - 1)
    with pytest.raises(NotFound, match="expired") as gone:
        signer.verify(expired)
    assert gone.value.code == "expired"


@pytest.mark.parametrize(
    "forge",
    [
        lambda t: "0" + t,
        lambda t: t[:-1],
        lambda t: "x.y",
        str.upper,
        lambda t: t[:-1] + "é",  # not ASCII: it was a 500
        lambda t: "é" + t,
    ],
)
def test_a_changed_token_or_another_servers_opens_nothing(forge):
    signer = LinkSigner()
    token = signer.sign(["job", "ckpt", "config.json"], expires=time.time() + 60)
    with pytest.raises(NotFound, match="not found"):
        signer.verify(forge(token))
    with pytest.raises(NotFound, match="not found"):
        LinkSigner().verify(token)  # a restarted server draws a new key
