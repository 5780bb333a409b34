"""The client's edges: argument checking, legacy arguments, errors from the server as our own
exception types, reconnecting, the ray backend's argument check, and a launched local server."""

from __future__ import annotations

import pickle
import sys
import types

import numpy as np
import pytest
import torch

from arctic_platform.client import (
    AuthenticationError,
    InvalidRequestError,
    JobNotConfiguredError,
    NotFoundError,
    SyncArcticRLClient,
    create_arctic_rl_client,
    make_transport,
)
from arctic_platform.client.config import load_config
from tests.client.conftest import TINY, Recording, backend_config, make_app
from tests.client.grpo import PROMPTS, SAMPLING, build_batch
from tests.live_server import serve_app
from tests.sampled import sampled


@pytest.fixture(scope="module")
def http_config(server_url, tmp_path_factory):
    return load_config(
        {
            "model": TINY,
            "seed": 2,
            "backend": backend_config("http", server_url, tmp_path_factory.mktemp("http")),
            "training": {"optimizer": {"lr": 1e-3}},
            "sampling": {},
        }
    )


@pytest.fixture(scope="module")
def client(http_config):
    recording = Recording(make_transport(http_config))
    with SyncArcticRLClient(http_config, transport=recording) as client:
        yield client


@pytest.fixture(scope="module")
def batch(client):
    return build_batch(client.generate(PROMPTS, SAMPLING))


# -- arguments --------------------------------------------------------------------------------


def test_unknown_keyword_arguments_are_type_errors(client, batch):
    with pytest.raises(TypeError, match="procesing"):
        client.fwd_bwd({"batch": batch}, procesing={"loss_fn": "verl_grpo"})
    with pytest.raises(TypeError, match="temprature"):
        client.generate(PROMPTS, temprature=1.0)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda c, b: c.fwd_bwd("tensors"), TypeError, "batch must be a dict"),
        (
            lambda c, b: c.fwd_bwd({"batch": {**b, "input_ids": b["input_ids"].tolist()}}),
            TypeError,
            "batch['input_ids'] must be a numpy array or torch tensor, got list",
        ),
        (
            lambda c, b: c.fwd_bwd({"batch": b, "meat": {}}),
            TypeError,
            "unknown envelope key 'meat' (did you mean 'meta'?)",
        ),
        (lambda c, b: c.fwd_bwd({"batch": b, "meta": 3}), TypeError, "meta must be a dict"),
        (lambda c, b: c.fwd_bwd({"batch": {}}), TypeError, "non-empty dict of tensors"),
        (
            lambda c, b: c.fwd_no_grad({"batch": b}, reference_model="yes"),
            TypeError,
            "reference_model must be True or False",
        ),
        (lambda c, b: c.generate("2+2="), TypeError, "wrap a single prompt in a list"),
        (
            lambda c, b: c.generate([[40, "x"]]),
            TypeError,
            "prompts[0] must be a string or a non-empty list of token ids",
        ),
        (lambda c, b: c.generate([]), ValueError, "prompts is empty"),
        (lambda c, b: c.generate(PROMPTS, 0.7), TypeError, "sampling_params must be a dict"),
        (lambda c, b: c.generate(PROMPTS, strict="yes"), TypeError, "strict must be True or False"),
        (
            lambda c, b: c.generate(PROMPTS, prompt_ids=[1, 2]),
            TypeError,
            "prompts or prompt_ids, not both",
        ),
        (lambda c, b: c.step(-0.1), ValueError, "learning_rate must be > 0"),
        (lambda c, b: c.step("fast"), TypeError, "learning_rate must be a number"),
        (lambda c, b: c.sleep_inference(level=3), ValueError, "level must be 1 or 2"),
        (lambda c, b: c.wake_inference("weights"), TypeError, "tags must be a list of strings"),
        (
            lambda c, b: c.sync_weights(cuda_ipc="no"),
            TypeError,
            "cuda_ipc must be True, False or None",
        ),
        (
            lambda c, b: c.load_checkpoint("/x", checkpoint_id="checkpoint-1"),
            ValueError,
            "path or checkpoint_id, not both",
        ),
        (
            lambda c, b: c.fwd_no_grad({"batch": b}, reference_model=True),
            JobNotConfiguredError,
            "no log_prob job",
        ),
        (lambda c, b: c.log_probs(["a"]), JobNotConfiguredError, "add a `log_prob:` section"),
    ],
)
def test_bad_arguments_fail_before_anything_is_sent(client, batch, call, error, message):
    sent = len(client.transport.requests)
    with pytest.raises(error) as info:
        call(client, batch)
    assert message in str(info.value)
    assert len(client.transport.requests) == sent


# -- legacy arguments and request shapes ------------------------------------------------------


def test_legacy_keyword_arguments_fold_into_the_body(client, batch):
    meta = {"batch_num_tokens": int(batch["response_mask"].sum())}
    tensors = {**batch, "old_log_probs": np.zeros(batch["input_ids"].shape, np.float32)}
    envelope = client.fwd_bwd(
        {"batch": tensors, "meta": meta},
        processing={
            "loss_fn": "verl_grpo",
            "post": ["apply_temperature", "compute_entropy_and_logprobs"],
        },
    )
    body = client.transport.requests[-1].body
    assert body["processing"]["loss_fn"] == "verl_grpo" and body["meta"] == meta
    flat = client.fwd_bwd(
        tensors, meta=meta, loss_fn="verl_grpo", loss_fn_config={"calculate_entropy": True}
    )
    body = client.transport.requests[-1].body
    assert set(body) == {"batch", "meta", "processing"}
    assert body["processing"] == {"loss_fn": "verl_grpo", "config": {"calculate_entropy": True}}
    assert flat["metrics"]["actor/pg_loss"] == envelope["metrics"]["actor/pg_loss"]
    client.step()


def test_prompt_ids_is_the_legacy_name_of_one_tokenized_prompt(client):
    with_ids = client.generate(prompt_ids=np.array(PROMPTS[0]), sampling_params=SAMPLING)
    with_prompts = client.generate([PROMPTS[0]], SAMPLING)
    assert with_ids == with_prompts
    assert client.transport.requests[-1].body == {
        "prompts": [PROMPTS[0]],
        "sampling_params": SAMPLING,
        "strict": False,
    }


def test_sync_weights_is_the_four_call_sequence(client):
    start = len(client.transport.requests)
    answer = client.sync_weights(cuda_ipc=False)
    sent = client.transport.requests[start:]
    assert [r.op for r in sent] == ["wake-inference", "operation", "wake-inference", "operation"]
    assert sent[0].body == ["weights"] and sent[2].body == ["kv_cache"]
    assert sent[1].job_id == client.training_job_id
    assert sent[1].body == {
        "operation_type": "weight-sync",
        "sub_job_id": client.training_job_id,
        "sub_job_type": "training",
        "payload": {
            "source_sub_job_id": client.training_job_id,
            "target_sub_job_ids": [client.sampling_job_id],
            "cuda_ipc": False,
        },
    }
    assert sent[3].body["operation_type"] == "reset-prefix-cache"
    assert answer["status"] == "ok" and answer["targets"][0]["sub_job_id"] == client.sampling_job_id


def test_default_tensor_type_follows_torch(client, batch):
    """With torch installed, ``tensor_type: auto`` answers with torch tensors (as SkyRL expects)."""
    logprobs = client.fwd_no_grad({"batch": batch})["batch"]["logprobs"]
    assert isinstance(logprobs, torch.Tensor) and logprobs.dtype == torch.float32
    logprobs.mul_(0)  # writable: the response was read into a mutable buffer


# -- server errors ----------------------------------------------------------------------------


def test_server_refusals_are_our_exceptions(client, batch):
    with pytest.raises(InvalidRequestError) as info:
        client.fwd_bwd({"batch": batch}, router_replay={"layers": []})
    assert info.value.status == 400 and "router_replay" in info.value.message
    with pytest.raises(InvalidRequestError, match="sleep-training: mode"):
        client.sleep_training(mode="gpu")


def test_attaching_to_unknown_jobs_is_not_found(http_config):
    config = http_config.model_copy(update={"training_job_id": "0000:training:0"})
    with pytest.raises(NotFoundError) as info:
        create_arctic_rl_client(config, blocking_calls=True)
    assert info.value.status == 404 and info.value.code == "not_found"


@pytest.mark.parametrize("kind", ["http", "cortex"])
def test_tokens_are_checked(service, tmp_path, monkeypatch, kind):
    monkeypatch.setenv("GOOD_TOKEN", "s3cret")
    monkeypatch.setenv("BAD_TOKEN", "guess")
    with serve_app(make_app(service, tokens=["s3cret"])) as url:
        variable = "token_env" if kind == "http" else "pat_env_var"
        config = {"model": TINY, "training": {}, "backend": backend_config(kind, url, tmp_path)}
        config["backend"][variable] = "BAD_TOKEN"
        with pytest.raises(AuthenticationError) as info:
            create_arctic_rl_client(config, blocking_calls=True)
        assert info.value.status == 401
        config["backend"][variable] = "GOOD_TOKEN"
        with create_arctic_rl_client(config, blocking_calls=True) as authed:
            assert authed.step()["global_steps"] == 1
    monkeypatch.delenv("MISSING", raising=False)
    with pytest.raises(ValueError, match="MISSING"):
        create_arctic_rl_client(
            {"model": TINY, "backend": {"type": "http", "url": url, "token_env": "MISSING"}}
        )


# -- reconnecting -----------------------------------------------------------------------------


def test_reconnect_attaches_without_creating_or_destroying(client, http_config):
    config = client.reconnect_config()
    assert pickle.loads(pickle.dumps(config)) == config  # it travels to Ray tasks
    assert (config.training_job_id, config.sampling_job_id) == (
        client.training_job_id,
        client.sampling_job_id,
    )
    assert client.get_server_state() is None
    only_training = http_config.model_copy(update={"training_job_id": client.training_job_id})
    with create_arctic_rl_client(only_training, blocking_calls=True) as attached:
        assert attached.training_job_id == client.training_job_id
        assert attached.sampling_job_id is None
        with pytest.raises(JobNotConfiguredError, match="no sampling job"):
            attached.generate(PROMPTS)
    assert client.generate(PROMPTS, SAMPLING)  # the attached client left the jobs running
    with pytest.raises(ValueError, match="server_state"):
        create_arctic_rl_client(config, server_state=object())


def test_a_yaml_path_is_a_config(client, tmp_path):
    path = tmp_path / "reconnect.yaml"
    client.reconnect_config().to_yaml(path)
    with create_arctic_rl_client(str(path), blocking_calls=True) as attached:
        assert attached.jobs == client.jobs


def test_inprocess_server_state_is_the_service(tmp_path):
    config = {"model": TINY, "backend": backend_config("inprocess", None, tmp_path), "sampling": {}}
    with create_arctic_rl_client(config, blocking_calls=True) as first:
        state = first.get_server_state()
        second = create_arctic_rl_client(
            first.reconnect_config(), arctic_rl_server_state=state, blocking_calls=True
        )
        assert second.jobs == first.jobs
        assert sampled(second.generate(PROMPTS, SAMPLING)) == sampled(
            first.generate(PROMPTS, SAMPLING)
        )
        second.shutdown()
        assert first.step()["global_steps"] == 1  # the first client's jobs outlive the second


# -- the ray backend --------------------------------------------------------------------------


def test_ray_without_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` fail, installed or not
    with pytest.raises(ImportError, match=r"arctic-platform\[ray\]"):
        create_arctic_rl_client({"model": TINY, "backend": {"type": "ray"}})


def test_ray_server_state_needs_the_job_ids(monkeypatch):
    # Checked before Ray is touched (the Ray backend itself is tested in tests/ray).
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))
    with pytest.raises(ValueError, match="reconnecting also needs the job ids"):
        create_arctic_rl_client({"model": TINY, "backend": {"type": "ray"}}, server_state=object())


# -- a launched local server ------------------------------------------------------------------


@pytest.mark.slow
def test_launch_local_server_starts_and_stops_arctic_platform_serve(tmp_path):
    config = {
        "model": TINY,
        "backend": {
            "type": "http",
            "port": 0,
            "launch_local_server": True,
            "data_dir": str(tmp_path),
            "device": "cpu",
            "startup_timeout": 120,
        },
    }
    client = create_arctic_rl_client(config, blocking_calls=True)
    process = client.transport._server._process
    assert process is not None and process.poll() is None
    assert client.step()["global_steps"] == 1
    reconnect = client.reconnect_config()
    assert reconnect.backend.url.startswith("http://127.0.0.1:")
    assert not reconnect.backend.launch_local_server
    with create_arctic_rl_client(reconnect, blocking_calls=True) as attached:
        assert attached.step()["global_steps"] == 2
    assert process.poll() is None  # only the client that launched the server stops it
    client.shutdown()
    assert process.poll() is not None


def test_numpy_results_keep_bf16_tensors_as_ml_dtypes_arrays():
    import ml_dtypes
    import torch

    from arctic_platform.client.tensors import to_python, torch_to_numpy

    tensor = torch.tensor([[1.5, -2.25]], dtype=torch.bfloat16)
    converted = torch_to_numpy({"logprobs": tensor, "steps": (torch.tensor(3),)})
    assert converted["logprobs"].dtype == ml_dtypes.bfloat16
    assert converted["logprobs"].astype("float32").tolist() == [[1.5, -2.25]]
    assert converted["steps"][0].tolist() == 3
    assert to_python({"x": tensor}) == {"x": [[1.5, -2.25]]}


def test_generate_logprobs_come_out_flat(client):
    """The engines' entries, with vLLM's rank of the sampled token, on every backend."""
    (out,) = client.generate(["1+2="], {"max_tokens": 4, "logprobs": 2, "seed": 5})
    assert len(out["logprobs"]) == len(out["token_ids"])
    for token, entry in zip(out["token_ids"], out["logprobs"], strict=True):
        assert set(entry) == {"token_id", "logprob", "rank", "top"}
        assert entry["token_id"] == token and entry["rank"] >= 1
        assert len(entry["top"]) == 2
        values = [v for _, v in entry["top"]]
        assert values == sorted(values, reverse=True)
        if entry["rank"] <= 2:  # among the two likeliest: listed at its rank
            assert entry["top"][entry["rank"] - 1] == [token, entry["logprob"]]


def test_inprocess_server_state_refuses_to_leave_its_process_naming_the_fix(tmp_path):
    """SkyRL ships get_server_state() to a Ray task; the inprocess state cannot travel."""
    import pickle

    config = {
        "model": TINY,
        "backend": backend_config("inprocess", None, tmp_path),
        "training": None,
        "sampling": {},
    }
    refused = pytest.raises(TypeError, match="cannot be sent to another process.*ray backend")
    with create_arctic_rl_client(config, blocking_calls=True) as client, refused:
        pickle.dumps(client.get_server_state())
