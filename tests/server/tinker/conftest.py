"""The real ``tinker`` SDK (PyPI, a test dependency) against our server on loopback.

One server per module (engines take seconds to load on CPU); two tenants, ``tml-alice`` and
``tml-bob``, in the form the SDK requires. Tests that need untouched weights create their own
training client; a LoRA adapter starts as the identity (peft initialises B to zero), so a fresh
client computes exactly what the base model computes, which :func:`reference_logprobs` evaluates
with plain transformers.
"""

from __future__ import annotations

import functools

import pytest
import torch

from arctic_platform.engine.config import ModelConfig
from arctic_platform.engine.models import load_causal_lm
from arctic_platform.server.app import create_app
from arctic_platform.server.auth import TokenAuth
from arctic_platform.server.service import Service, ServiceSettings
from tests.live_server import serve_app

tinker = pytest.importorskip("tinker", reason="the tinker SDK (Python >= 3.11) is not installed")

TINY = "builtin:tiny"
ALICE, BOB = "tml-alice", "tml-bob"


@pytest.fixture(scope="module")
def server_app(tmp_path_factory):
    data = tmp_path_factory.mktemp("tinker-data")
    service = Service(ServiceSettings(data_dir=data, device="cpu"))
    return create_app(service, auth=TokenAuth([ALICE, BOB]))


@pytest.fixture(scope="module")
def server_url(server_app):
    with serve_app(server_app) as url:
        yield url


@pytest.fixture(scope="module")
def service_client(server_url):
    client = tinker.ServiceClient(base_url=server_url, api_key=ALICE)
    yield client
    client.close("success").result()


@functools.cache
def _reference_model():
    return load_causal_lm(ModelConfig(name=TINY, device="cpu")).eval()


def reference_logprobs(tokens: list[int], targets: list[int]) -> list[float]:
    """``log p(targets[j] | tokens[:j+1])`` under the base model, by plain transformers."""
    with torch.no_grad():
        logits = _reference_model()(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[j, t]) for j, t in enumerate(targets)]


def encode(text: str) -> list[int]:
    from arctic_platform.engine.builtin import build_tokenizer

    return build_tokenizer().encode(text, add_special_tokens=False)
