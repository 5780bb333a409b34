"""Choosing the sampling engine: config edges, the server's default, and failing with a reason.

These run without vLLM: they check how ``sampling.engine``/``sampling.vllm`` (and the legacy
``vllm_config``) travel from the client config, ``--set`` and the create-job body to the engine
config, which bad values are refused with the field named, and that a vLLM job on a machine
without vLLM fails at start with a reason that says how to set it up.
"""

from __future__ import annotations

import pytest

from arctic_platform.client.config import ArcticRLClientConfig
from arctic_platform.contract.job_config import CreateJobRequest
from arctic_platform.recipes.config import load_recipe
from arctic_platform.server.errors import BadRequest
from arctic_platform.server.job_config import sampling_engine_config
from arctic_platform.server.service import Service, ServiceSettings
from tests.server.conftest import sub_job


def _client(**sampling) -> ArcticRLClientConfig:
    return ArcticRLClientConfig.model_validate(
        {"model": "builtin:tiny", "training": None, "sampling": sampling}
    )


def test_client_config_selects_vllm_and_its_settings():
    config = _client(engine="vllm", vllm={"weight_sync": "reload", "max_num_seqs": 4})
    settings = config.create_job_body()["sub_job_configs"][0]["inference_config"]
    assert settings["engine"] == "vllm"
    assert settings["vllm_config"] == {"weight_sync": "reload", "max_num_seqs": 4}
    spec = config.to_create_job_request().sub_job_configs[0]
    engine = sampling_engine_config(spec, device="cpu", vllm_python="/opt/vllm/bin/python")
    assert engine.engine == "vllm" and engine.max_batch_size == 4
    assert engine.vllm.weight_sync == "reload" and engine.vllm.python == "/opt/vllm/bin/python"
    assert engine.vllm.engine_args == {"max_num_seqs": 4}
    assert spec.ignored_settings == {}  # the vLLM engine uses every key
    assert engine.prompt_cache_bytes > 0  # on by default, as vLLM's prefix caching


@pytest.mark.parametrize(("switch", "on"), [(False, False), (True, True), (None, True)])
def test_vllms_prefix_caching_switch_also_turns_off_our_prompt_cache(switch, on):
    """``null`` is vLLM's own default (on), as leaving the key out."""
    spec = _client(vllm={"enable_prefix_caching": switch}).to_create_job_request()
    assert spec.sub_job_configs[0].ignored_settings == {}
    cache = sampling_engine_config(spec.sub_job_configs[0], device="cpu").prompt_cache_bytes
    assert (cache > 0) is on


def test_vllms_kv_cache_size_is_also_our_samplers_kv_budget():
    """``kv_cache_memory_bytes`` bounds our running batch and prompt cache as it bounds vLLM's KV
    cache, so a job can give either engine room with one key."""
    spec = _client(vllm={"kv_cache_memory_bytes": 2**28}).to_create_job_request()
    assert spec.sub_job_configs[0].ignored_settings == {}
    engine = sampling_engine_config(spec.sub_job_configs[0], device="cpu")
    assert engine.max_kv_cache_bytes == 2**28
    default = _client().to_create_job_request().sub_job_configs[0]
    assert sampling_engine_config(default, device="cpu").max_kv_cache_bytes == 4 * 2**30


def test_legacy_vllm_config_folds_into_sampling_vllm():
    top = ArcticRLClientConfig.model_validate(
        {"model": "builtin:tiny", "sampling": {}, "vllm_config": {"max_num_seqs": 8}}
    )
    assert top.sampling.vllm == {"max_num_seqs": 8}
    nested = _client(vllm_config={"max_num_seqs": 8, "enforce_eager": True}, vllm={"seed": 1})
    assert nested.sampling.vllm == {"max_num_seqs": 8, "enforce_eager": True, "seed": 1}
    explicit_wins = _client(vllm_config={"max_num_seqs": 8}, vllm={"max_num_seqs": 2})
    assert explicit_wins.sampling.vllm == {"max_num_seqs": 2}
    # With our engine, the vLLM keys our sampler does not use are reported as ignored.
    spec = _client(vllm={"max_num_seqs": 8, "enforce_eager": True}).to_create_job_request()
    assert spec.sub_job_configs[0].ignored_settings == {"vllm_config.enforce_eager": True}


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"engine": "sglang"}, "sampling.engine"),
        ({"engine": "vllm", "vllm": {"weight_sync": "sometimes"}}, "weight_sync"),
        ({"engine": "vllm", "vllm": {"env": ["A=1"]}}, "env"),
        ({"engine": "vllm", "vllm": {"model": "other"}}, "model: the job's model is what vLLM"),
        ({"vllm_config": "fast"}, "vllm_config: expected a mapping"),
        ({"vllm": {"enable_prefix_caching": "no"}}, "enable_prefix_caching: expected true"),
        ({"vllm": {"kv_cache_memory_bytes": "1GiB"}}, "kv_cache_memory_bytes: expected a posit"),
        ({"vllm": {"kv_cache_memory_bytes": 0}}, "kv_cache_memory_bytes: expected a positive"),
        ({"vllm": {"kv_cache_memory_bytes": True}}, "kv_cache_memory_bytes: expected a posit"),
    ],
)
def test_bad_engine_settings_name_the_field(sampling, message):
    with pytest.raises(ValueError, match=message):
        _client(**sampling).to_create_job_request()


def test_log_prob_jobs_score_with_our_engine():
    with pytest.raises(ValueError, match="inference_config.engine: vllm runs sampling sub-jobs"):
        CreateJobRequest.model_validate(
            {"sub_job_configs": [sub_job("log_probability", inference_config={"engine": "vllm"})]}
        )


def test_set_reaches_the_client_job_sections():
    recipe = load_recipe(None, ["sampling.engine=vllm", "sampling.vllm.weight_sync=reload"])
    assert recipe.client.sampling.engine == "vllm"
    assert recipe.client.sampling.vllm == {"weight_sync": "reload"}
    with pytest.raises(ValueError, match="engine"):
        load_recipe(None, ["sampling.engine=fast"])


@pytest.fixture
def vllm_server(tmp_path):
    """A server whose operator made vLLM the default sampling engine (as serve does)."""
    svc = Service(ServiceSettings(data_dir=tmp_path / "data", device="cpu", sampling_engine="vllm"))
    yield svc
    svc.close()


def test_the_servers_default_engine_is_recorded_in_the_job(vllm_server):
    info = vllm_server.create_job(
        {"sub_job_configs": [sub_job("sampling"), sub_job("sampling", inference_config={})]}
    )
    job = vllm_server.jobs.get(info["job_id"], None)
    assert [s.spec.inference_config.engine for s in job.sub_jobs] == ["vllm", "vllm"]
    chosen = vllm_server.create_job(
        {"sub_job_configs": [sub_job("sampling", inference_config={"engine": "torch"})]}
    )
    job = vllm_server.jobs.get(chosen["job_id"], None)
    assert job.sub_jobs[0].spec.inference_config.engine == "torch"


def test_a_job_cannot_name_the_servers_vllm_interpreter(vllm_server):
    spec = sub_job("sampling", inference_config={"vllm_config": {"python": "/tmp/evil"}})
    with pytest.raises(BadRequest, match="vllm_config.python: this server runs vLLM with"):
        vllm_server.create_job({"sub_job_configs": [spec]})
    assert vllm_server.list_jobs() == []


# What a tenant's job would reach through vLLM's process: code (LD_PRELOAD, PYTHONPATH, plugins,
# a model's remote code), files outside its space, devices it was not given.
FORBIDDEN_VLLM = [
    ({"env": {"LD_PRELOAD": "/tmp/evil.so"}}, "env.LD_PRELOAD"),
    ({"env": {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": "/tmp/x"}}, "env.PYTHONPATH"),
    ({"env": {"VLLM_PLUGINS": "evil"}}, "env.VLLM_PLUGINS"),
    ({"env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}}, "env.CUDA_VISIBLE_DEVICES"),
    ({"trust_remote_code": True}, "trust_remote_code"),
    ({"tokenizer": "/etc/ssl"}, "tokenizer"),
    ({"download_dir": "/tmp/outside"}, "download_dir"),
    ({"speculative_config": {"model": "/data/tenants/other"}}, "speculative_config"),
    ({"worker_extension_cls": "os.system"}, "worker_extension_cls"),
]


@pytest.mark.parametrize(("vllm", "key"), FORBIDDEN_VLLM, ids=[k for _, k in FORBIDDEN_VLLM])
def test_a_tenants_vllm_job_sets_only_what_sizes_and_tunes_its_engine(vllm_server, vllm, key):
    """A job's ``vllm_config`` becomes the environment and engine arguments of a process the
    server starts as itself: beyond the sizing and tuning knobs it is a 400 naming the key,
    before any process starts, on every surface that creates jobs (they all build here)."""
    spec = sub_job("sampling", inference_config={"vllm_config": vllm})
    with pytest.raises(BadRequest) as refused:
        vllm_server.create_job({"sub_job_configs": [spec]})
    field = f"sub_job_configs.0.inference_config.vllm_config.{key}"
    assert refused.value.details["field"] == field
    assert refused.value.message.startswith(field + ": a job on this server may")
    assert vllm_server.list_jobs() == []


def test_the_vllm_knobs_rl_frameworks_send_are_a_tenants_to_set(vllm_server):
    """verl's and SkyRL's ``vllm_config`` keys pass on a vLLM job, and any key passes where
    the sampling engine is ours (unused there, reported as ignored): SkyRL's defaults add keys
    of its own."""
    knobs = {
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.3,
        "max_model_len": 256,
        "max_num_seqs": 8,
        "enforce_eager": True,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "max_num_batched_tokens": 2048,
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
    }
    sampling = sub_job("sampling", inference_config={"vllm_config": knobs})
    created = vllm_server.create_job({"sub_job_configs": [sampling]})
    vllm_server.cancel_job(created["job_id"])
    ours = {"engine": "torch", "vllm_config": {"forest_cascade_attn_configs": "{}", **knobs}}
    created = vllm_server.create_job(
        {"sub_job_configs": [sub_job("sampling", inference_config=ours)]}
    )
    vllm_server.cancel_job(created["job_id"])


def test_a_vllm_job_without_vllm_fails_with_the_setup_hint(vllm_server, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.delenv("ARCTIC_VLLM_PYTHON", raising=False)
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is importable here, so the default interpreter would run it")
    info = vllm_server.create_job({"sub_job_configs": [sub_job("sampling")]})
    with pytest.raises(Exception, match="failed"):
        vllm_server.wait_until_running(info["job_id"], timeout=300)
    reason = vllm_server.get_job(info["job_id"])["reason"]
    assert "VllmUnavailable" in reason and "ARCTIC_VLLM_PYTHON" in reason
