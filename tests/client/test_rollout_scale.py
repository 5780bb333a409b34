"""A real GRPO-sized rollout comes back through ``client.generate`` over on-prem and Cortex.

2048 samples x 4096 tokens with logprobs: in the reference list form this result makes a DSSST1
header of more than 64 MiB, which the codec refuses (``tests/contract/test_generate_columns.py``
shows that at a smaller size); the client asks for tensor columns, so it arrives intact on both
HTTP routes (on Cortex as chunked result events). Generating that many
tokens needs a GPU, so the server builds ``RolloutReplay`` as the sampling sub-job's engine, a
stand-in that hands back a prepared rollout; the server, routes, transports and codec are the real
ones.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import numpy as np
import pytest

from arctic_platform.client import create_arctic_rl_client
from tests.client.conftest import TINY, backend_config, make_app
from tests.live_server import serve_app

SAMPLES, TOKENS = 2048, 4096


class RolloutReplay:
    """Stands in for a GPU sampler: ``generate`` returns a prepared rollout (its other members
    are the sampling Protocol's, ``contract/engine_protocols.py``, as the server reads them)."""

    vocab_size = 150_000
    max_model_len = 5 + TOKENS
    concurrent_generate = False  # no running batch: one rollout at a time

    def __init__(self, outputs: list[dict]) -> None:
        self.outputs = outputs

    def generate(self, prompts, sampling_params=None) -> list[dict]:
        return self.outputs

    def close(self) -> None:
        """Nothing held."""


@pytest.fixture(scope="module")
def rollout() -> Iterator[list[dict]]:
    """8M logprob dicts, built with the cyclic GC off (its passes over the growing heap took most
    of a minute) and then frozen, so the collections the test's decoding triggers skip them."""
    gc.disable()
    try:
        out = build_rollout()
    finally:
        gc.enable()
    gc.freeze()
    yield out
    gc.unfreeze()


def build_rollout() -> list[dict]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, SAMPLES * TOKENS).tolist()
    values = np.log(rng.random(SAMPLES * TOKENS, dtype=np.float32) + 1e-6).tolist()
    out = []
    for i in range(SAMPLES):
        span = slice(i * TOKENS, (i + 1) * TOKENS)
        out.append(
            {
                "text": "x" * TOKENS,
                "token_ids": ids[span],
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_len": 5,
                "prompt_index": i // 8,
                "sample_index": i % 8,
                "logprobs": [
                    {"token_id": t, "logprob": v, "top": []}
                    for t, v in zip(ids[span], values[span], strict=True)
                ],
            }
        )
    return out


@pytest.fixture(scope="module")
def replay_server(rollout, tmp_path_factory):
    """Our real server, whose sampling sub-jobs run ``RolloutReplay`` and whose other sub-jobs
    (the client's training job, not used here) run FakeEngine: no model is built."""
    from arctic_platform.server.service import Service, ServiceSettings
    from tests.fake_engine import build_fake_engine

    def replay_engine(service, sub, source):
        if sub.kind == "sampling":
            return RolloutReplay(rollout)
        return build_fake_engine(service, sub, source)

    service = Service(
        ServiceSettings(data_dir=tmp_path_factory.mktemp("server"), device="cpu"),
        engine_builder=replay_engine,
    )
    with serve_app(make_app(service)) as url:
        yield url
    service.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["http", "cortex"])
def test_a_2048_by_4096_rollout_with_logprobs_arrives_intact(
    kind, rollout, replay_server, tmp_path
):
    config = {
        "model": TINY,
        "tensor_type": "numpy",
        "backend": backend_config(kind, replay_server, tmp_path),
        "sampling": {},
    }
    with create_arctic_rl_client(config, blocking_calls=True) as client:
        received = client.generate(["1+1="], {"logprobs": 0})
    assert len(received) == SAMPLES
    assert received == rollout
