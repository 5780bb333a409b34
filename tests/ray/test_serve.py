"""``arctic-platform serve --ray``: the HTTP APIs over a Ray-backed Service.

The server runs in a thread of this process (the Service and its FastAPI app exactly as ``serve
--ray`` builds them), attached to the test cluster. A Cortex client creates a job with 2 training
workers and trains; an on-prem HTTP client attaches to the same job by id and steps it. The
losses match one in-process engine on the same batch. The command line's Ray flags are checked
in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from arctic_platform.client import create_arctic_rl_client
from arctic_platform.layout import training_batch
from tests.client.conftest import backend_config
from tests.live_server import serve_app

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

TINY = "builtin:tiny"
BATCH = training_batch(
    [[40, 41, 42], [50, 51], [43, 44, 45, 46], [52]],
    [[60, 61, 62, 63], [70, 71], [64], [72, 73, 74, 75, 76]],
    pad_token_id=0,
    advantages=[1.0, -1.0, 0.5, -0.5],
)
BATCH["old_log_probs"] = np.full(BATCH["input_ids"].shape, -4.0, np.float32)
BODY = {"batch": BATCH, "processing": {"loss_fn": "verl_grpo"}}


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tmp_path_factory):
    from arctic_platform.server.app import create_app
    from arctic_platform.server.auth import TokenAuth
    from arctic_platform.server.service import Service, ServiceSettings

    service = Service(
        ServiceSettings(
            data_dir=tmp_path_factory.mktemp("serve"), device="cpu", engine_backend="ray"
        )
    )
    with serve_app(create_app(service, auth=TokenAuth([]))) as url:
        yield url


def test_cortex_and_http_clients_train_on_ray_workers(ray_server, tmp_path):
    job = {"model": TINY, "seed": 2, "training": {"n_gpus": 2}}
    cortex = create_arctic_rl_client(
        {**job, "backend": backend_config("cortex", ray_server, tmp_path)}, blocking_calls=True
    )
    with cortex:
        trained = cortex.fwd_bwd(BODY)
        assert cortex.step()["global_steps"] == 1
        attach = {
            "model": TINY,
            "backend": backend_config("http", ray_server, tmp_path),
            "training_job_id": cortex.training_job_id,
        }
        with create_arctic_rl_client(attach, blocking_calls=True) as http:
            http.fwd_bwd(BODY)
            assert http.step()["global_steps"] == 2
    local = {**job, "backend": backend_config("inprocess", None, tmp_path / "local")}
    with create_arctic_rl_client(local, blocking_calls=True) as reference:
        expected = reference.fwd_bwd(BODY)
    assert trained["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    for name, value in expected["metrics"].items():
        assert trained["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ray", "--ray-address", "127.0.0.1:1"], "--ray-address: no Ray cluster answers"),
        (["--colocate"], "--ray-address, --colocate and --ray-autoscaling need --ray"),
        (["--ray", "--placement-timeout", "0"], "--placement-timeout: must be > 0 seconds"),
    ],
)
def test_serve_ray_flags_fail_clearly(tmp_path, args, message):
    result = subprocess.run(
        [sys.executable, "-m", "arctic_platform.cli", "serve", "--data-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


def test_tinker_sampling_clients_keep_their_snapshot_on_ray(ray_server):
    """A Tinker sampling client from ``save_weights_and_get_sampling_client`` samples the weights
    of that moment on Ray too, after the trainer (a Ray worker) trained on and saved again."""
    tinker = pytest.importorskip("tinker", reason="the tinker SDK (Python >= 3.11)")
    from tests.server.tinker.conftest import check_snapshots_keep_their_weights

    service = tinker.ServiceClient(base_url=ray_server, api_key="tml-ray")
    try:
        check_snapshots_keep_their_weights(service)
    finally:
        service.close("success").result()


def test_openai_chat_and_logprobs_on_ray_are_our_generate(ray_server, tmp_path):
    """The OpenAI-compatible API on ``serve --ray``, where the engines (and their tokenizers)
    live in Ray actors: chat renders the model's template and logprobs spell their tokens with
    the tokenizer the API server loads from the model's folder; the samples are our client's
    ``generate`` with the same seed."""
    openai = pytest.importorskip("openai", reason="the openai SDK (dev extra) is not installed")
    from transformers import AutoTokenizer

    from arctic_platform.engine.builtin import builtin_model_path

    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path(TINY))
    sdk = openai.OpenAI(base_url=ray_server + "/v1", api_key="unused", max_retries=0, timeout=300)
    params = {"n": 2, "max_tokens": 5, "seed": 3, "temperature": 1.0}
    messages = [{"role": "user", "content": "What is 1+2?"}]
    chat = sdk.chat.completions.create(
        model=TINY, messages=messages, logprobs=True, top_logprobs=2, **params
    )
    completion = sdk.completions.create(model=TINY, prompt="1+2=", logprobs=2, **params)

    config = {"model": TINY, "backend": backend_config("http", ray_server, tmp_path)}
    with create_arctic_rl_client({**config, "sampling": {}}, blocking_calls=True) as client:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        ours_chat = client.generate([rendered], {**params, "logprobs": 2})
        ours = client.generate(["1+2="], {**params, "logprobs": 2})
    for choice, sample in zip(chat.choices, ours_chat, strict=True):
        assert choice.message.content == sample["text"]
        spelled = [tokenizer.decode([t]) for t in sample["token_ids"]]
        assert [e.token for e in choice.logprobs.content] == spelled
    for choice, sample in zip(completion.choices, ours, strict=True):
        assert choice.text == sample["text"]
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in sample["token_ids"]]
        assert choice.logprobs.token_logprobs == [e["logprob"] for e in sample["logprobs"]]
