"""A real GRPO-sized rollout comes back through ``client.generate`` over on-prem and Cortex.

2048 samples x 4096 tokens with logprobs: in the reference list form this result makes a DSSST1
header of more than 64 MiB, which the codec refuses (``tests/contract/test_generate_columns.py``
shows that at a smaller size); the client asks for tensor columns, so it arrives intact on both
HTTP routes (on Cortex as chunked result events). Generating that many
tokens needs a GPU, so the sampling sub-job's engine is swapped for ``RolloutReplay``, a stand-in
that hands back a prepared rollout; the server, routes, transports and codec are the real ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from arctic_platform.client import create_arctic_rl_client
from tests.client.conftest import TINY, backend_config

SAMPLES, TOKENS = 2048, 4096


class RolloutReplay:
    """Stands in for a GPU sampler: ``generate`` returns a prepared rollout (its other members
    are the sampling Protocol's, ``contract/engine_protocols.py``, as the server reads them)."""

    vocab_size = 150_000
    max_model_len = 5 + TOKENS
    concurrent_generate = False

    def __init__(self, outputs: list[dict]) -> None:
        self.outputs = outputs

    def generate(self, prompts, sampling_params=None) -> list[dict]:
        return self.outputs

    def close(self) -> None:
        """Nothing held."""


@pytest.fixture(scope="module")
def rollout() -> list[dict]:
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


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["http", "cortex"])
def test_a_2048_by_4096_rollout_with_logprobs_arrives_intact(
    kind, rollout, service, server_url, tmp_path
):
    config = {
        "model": TINY,
        "tensor_type": "numpy",
        "backend": backend_config(kind, server_url, tmp_path),
        "sampling": {},
    }
    with create_arctic_rl_client(config, blocking_calls=True) as client:
        sub = service.resolve(client.sampling_job_id, owner=None)
        sub.engine = RolloutReplay(rollout)
        received = client.generate(["1+1="], {"logprobs": 0})
    assert len(received) == SAMPLES
    assert received == rollout
