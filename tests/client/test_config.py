"""``ArcticRLClientConfig``: YAML, job specs, legacy fields, the environment override, errors."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from arctic_platform.client import (
    ArcticRLClientConfig,
    CortexBackend,
    HttpBackend,
    InProcessBackend,
    RayBackend,
    apply_env_override,
)
from arctic_platform.server.job_config import sampling_engine_config, training_engine_config

FULL = {
    "model": "builtin:tiny",
    "dtype": "float32",
    "seed": 7,
    "backend": {
        "type": "cortex",
        "base_url": "https://acct.example.com",
        "database": "DB",
        "schema": "RL",
        "pat_env_var": "MY_PAT",
        "max_request_bytes": 1 << 20,
    },
    "training": {
        "optimizer": {"lr": 2e-5, "betas": [0.9, 0.95], "weight_decay": 0.01, "grad_clip": 0.5},
        "schedule": {"name": "cosine", "warmup_steps": 3, "total_steps": 50, "min_lr_ratio": 0.1},
        "max_tokens_per_microbatch": 2048,
        "packing": False,
        "lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]},
        "save_total_limit": 2,
    },
    "sampling": {
        "model": "builtin:small",
        "max_batch_size": 32,
        "vllm_config": {"max_num_seqs": 8},
    },
    "log_prob": {"seed": 1},
}


def test_yaml_round_trip(tmp_path):
    config = ArcticRLClientConfig.model_validate(FULL)
    path = tmp_path / "client.yaml"
    config.to_yaml(path)
    again = ArcticRLClientConfig.from_yaml(path)
    assert again == config
    assert again.backend.schema_ == "RL" and "schema: RL" in path.read_text()
    assert "pat" not in path.read_text().replace("pat_env_var", "")


def test_from_yaml_reports_the_file_and_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="bad.yaml: expected a mapping"):
        ArcticRLClientConfig.from_yaml(path)
    path.write_text("model: builtin:tiny\ntraining: {optimizer: {lr: -1}}\n")
    with pytest.raises(ValidationError, match="training.optimizer.lr"):
        ArcticRLClientConfig.from_yaml(path)


def test_jobs_map_onto_the_servers_job_spec():
    """Every knob reaches the engine config the server builds (checked against literals)."""
    request = ArcticRLClientConfig.model_validate(FULL).to_create_job_request()
    kinds = [spec.job_type for spec in request.sub_job_configs]
    assert kinds == ["sampling", "log_probability", "training"]
    sampling, log_prob, training = request.sub_job_configs
    engine = training_engine_config(training, device="cpu", checkpoint_dir="/c", job_name="j")
    assert engine.model.name == "builtin:tiny" and engine.model.dtype == "float32"
    assert engine.seed == 7
    assert engine.optimizer.lr == 2e-5 and engine.optimizer.betas == (0.9, 0.95)
    assert engine.optimizer.weight_decay == 0.01 and engine.optimizer.grad_clip == 0.5
    assert engine.scheduler.model_dump() == {
        "name": "cosine",
        "warmup_steps": 3,
        "total_steps": 50,
        "min_lr_ratio": 0.1,
    }
    assert engine.max_tokens_per_microbatch == 2048 and engine.packing is False
    assert engine.save_total_limit == 2
    assert engine.model.lora.model_dump() == {
        "peft_type": "Lora",
        "r": 4,
        "alpha": 8.0,
        "dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "train_unembed": False,
    }
    sampler = sampling_engine_config(sampling, device="cpu")
    assert sampler.model.name == "builtin:small" and sampler.max_batch_size == 8
    assert sampler.seed == 7
    assert sampling_engine_config(log_prob, device="cpu").seed == 1


def test_only_configured_jobs_exist():
    config = ArcticRLClientConfig(model="m")
    assert list(config.jobs()) == ["training"]
    config = ArcticRLClientConfig(model="m", training=None, sampling={})
    assert list(config.jobs()) == ["sampling"]
    with pytest.raises(ValidationError, match="no job configured"):
        ArcticRLClientConfig(model="m", training=None)
    assert ArcticRLClientConfig(training=None, sampling_job_id="j:sampling:0").reconnecting


def test_model_is_required_unless_every_job_names_one():
    with pytest.raises(ValidationError, match="model: required"):
        ArcticRLClientConfig()
    config = ArcticRLClientConfig(training={"model": "builtin:tiny"})
    assert config.sub_job_configs()[0]["model_name"] == "builtin:tiny"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"model": "m", "traning": {}},
            "unknown field 'traning' in ArcticRLClientConfig (did you mean 'training'?)",
        ),
        (
            {"model": "m", "training": {"optimizer": {"lrr": 1}}},
            "unknown field 'lrr' in OptimizerConfig (did you mean 'lr'?)",
        ),
        (
            {"model": "m", "training": {"max_tokens_per_micro_batch": 1}},
            "did you mean 'max_tokens_per_microbatch'?",
        ),
        ({"model": "m", "backend": {"type": "http", "tokenenv": "X"}}, "did you mean 'token_env'?"),
        (
            {"model": "m", "backend": {"type": "htp"}},
            "unknown backend 'htp' (did you mean 'http'?)",
        ),
        ({"model": "m", "backend": "cortx"}, "unknown backend 'cortx' (did you mean 'cortex'?)"),
        ({"model_name": "m", "comm_protocl": "http"}, "did you mean 'comm_protocol'?"),
        ({"model": "m", "backend": {"url": "http://x"}}, "backend.type: required"),
    ],
)
def test_a_typo_names_the_field_and_suggests_the_right_one(data, expected):
    with pytest.raises(ValidationError) as info:
        ArcticRLClientConfig.model_validate(data)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"backend": {"type": "http", "port": 70000}}, "backend.http.port"),
        ({"backend": {"type": "http", "url": "ftp://box"}}, "url: expected an http"),
        ({"backend": {"type": "http", "port": 0}}, "port: 0"),
        ({"backend": {"type": "cortex", "database": "D", "schema": "S"}}, "base_url or host"),
        ({"backend": {"type": "cortex", "host": "h"}}, "database and schema"),
        (
            {"backend": {"type": "cortex", "base_url": "x", "database": "D", "schema": "S"}},
            "base_url: expected",
        ),
        ({"backend": {"type": "ray", "num_training_workers": 0}}, "num_training_workers"),
        ({"dtype": "fp8"}, "dtype"),
        ({"training": {"optimizer": {"lr": 0}}}, "training.optimizer.lr"),
        # Infinite and NaN settings travelled as null (lr) or were replaced (grad_clip: 1.0).
        ({"training": {"optimizer": {"lr": float("inf")}}}, "training.optimizer.lr"),
        ({"training": {"optimizer": {"grad_clip": float("nan")}}}, "training.optimizer.grad_clip"),
        ({"training": {"schedule": {"name": "cosine"}}}, "total_steps: the cosine schedule"),
        ({"training": {"lora": {"dropout": 1.5}}}, "training.lora.dropout"),
        ({"sampling": {"max_batch_size": -1}}, "sampling.max_batch_size"),
        ({"tensor_type": "jax"}, "tensor_type"),
        ({"training_gpus": -1}, "training_gpus: expected an integer >= 0"),
        ({"training_gpus": 0, "training": {}}, "training_gpus: 0 means no training job"),
        (
            {"backend": {"type": "remote", "pat": "secret", "base_url": "http://x"}},
            "backend.pat: secrets",
        ),
        ({"model_name": "a", "model": "b"}, "model_name: 'a' disagrees"),
        (
            {"backend": "local", "comm_protocol": "grpc"},
            "comm_protocol: expected http, ray or cortex",
        ),
    ],
)
def test_bad_values_name_the_field(data, field):
    with pytest.raises(ValidationError) as info:
        ArcticRLClientConfig.model_validate(
            {"model": "m", **data} if "model_name" not in data else data
        )
    assert field in str(info.value)


# -- legacy fields ----------------------------------------------------------------------------

SKYRL = {
    "model_name": "Qwen/Qwen3-0.6B",
    "backend": "local",
    "comm_protocol": "ray",
    "checkpoint_path": "/ckpt",
    "training_gpus": 2,
    "sampling_gpus": 1,
    "log_prob_gpus": 0,
    "log_prob_engine": "vllm",
    "colocate": True,
    "vllm_config": {"tensor_parallel_size": 1, "max_model_len": 1536, "max_num_seqs": 256},
    "ds_config": {
        "train_batch_size": 16,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-6, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {"stage": 3},
    },
    "ds_worker_config": {
        "use_liger": True,
        "enable_gradient_checkpointing": True,
        "max_token_len": 4608,
    },
    "training_config": {
        "training_horizon": 1000,
        "optimizer": {"lr": 1e-6, "weight_decay": 0.01},
        "lr_scheduler": {"type": "constant", "warmup_ratio": 0.05},
        "max_length": 1536,
        "model_config": None,
    },
    "arctic_inference_config": None,
    "full_determinism": False,
    "seed": 42,
    "startup_timeout": 1800.0,
    "server_logs": False,
}


def test_skyrl_config_folds_into_the_nested_form():
    config = ArcticRLClientConfig.model_validate(SKYRL)
    assert config.model == "Qwen/Qwen3-0.6B" and config.seed == 42
    assert config.backend == RayBackend(colocate=True)
    assert config.legacy_backend == "local"
    training = config.training
    assert training.n_gpus == 2 and training.max_seq_len == 1536 and training.train_batch_size == 16
    assert training.optimizer.lr == 1e-6 and training.optimizer.betas == (0.9, 0.95)
    assert training.optimizer.weight_decay == 0.01 and training.optimizer.grad_clip == 1.0
    assert training.schedule.name == "constant" and training.schedule.warmup_steps == 50
    assert training.gradient_checkpointing and training.max_tokens_per_microbatch == 4608
    assert training.checkpoint_dir == "/ckpt"
    assert config.sampling.n_gpus == 1 and config.sampling.vllm["max_model_len"] == 1536
    assert config.log_prob is None
    assert config.ignored_settings == {
        "ds_config.bf16": {"enabled": True},
        "ds_config.zero_optimization": {"stage": 3},
        "ds_worker_config.use_liger": True,
        "training_config.model_config": None,
        "arctic_inference_config": None,
        "full_determinism": False,
        "log_prob_engine": "vllm",
        "startup_timeout": 1800.0,
        "server_logs": False,
    }


def test_every_flat_field_skyrl_sets_reads_back_as_set():
    """SkyRL reads ``rl_config.comm_protocol`` right after building the client (entrypoint.py)."""
    skyrl = {
        **SKYRL,
        "ds_worker_config": {**SKYRL["ds_worker_config"], "attn_implementation": "sdpa"},
    }
    config = ArcticRLClientConfig.model_validate(skyrl)
    for name, value in skyrl.items():
        if name == "backend":  # the typed backend; the legacy name is kept as legacy_backend
            assert config.legacy_backend == value == "local"
            assert config.legacy_fields["backend"] == "local"
        else:
            assert getattr(config, name) == value, name
    assert config.comm_protocol == "ray"
    with pytest.raises(AttributeError):
        _ = config.not_a_field


def test_flat_fields_the_reference_verl_adapter_sets_read_back_as_set():
    verl = {
        "model_name": "m",
        "seed": 42,
        "max_seq_len": 1536,
        "training_gpus": 1,
        "sampling_gpus": 1,
        "log_prob_gpus": 1,
        "backend": {"type": "onprem", "protocol": "http", "host": "localhost", "port": 7000},
        "training": {"checkpoint_path": "/ckpt", "full_determinism": False, "cuda_ipc": False},
        "sampling": {"vllm": {"max_num_seqs": 8}, "log_prob_engine": "deepspeed"},
    }
    config = ArcticRLClientConfig.model_validate(verl)
    for name in ("model_name", "seed", "max_seq_len", "training_gpus", "sampling_gpus"):
        assert getattr(config, name) == verl[name], name
    assert config.log_prob_gpus == 1 and config.checkpoint_path == "/ckpt"
    assert config.comm_protocol == "http" and config.sampling.vllm == {"max_num_seqs": 8}


def test_unset_flat_fields_read_as_the_nested_equivalent():
    config = ArcticRLClientConfig.model_validate(
        {"model": "m", "backend": {"type": "http", "host": "box", "port": 7001}, "sampling": {}}
    )
    assert config.model_name == "m" and config.comm_protocol == "http"
    assert (config.host, config.port) == ("box", 7001)
    assert (config.training_gpus, config.sampling_gpus, config.log_prob_gpus) == (1, 1, 0)
    assert config.ds_config is None
    assert ArcticRLClientConfig.model_validate({"model": "m"}).comm_protocol is None


@pytest.mark.parametrize(
    "legacy",
    [
        {"ds_worker_config": {"attn_implementation": "eager"}},
        {"training_config": {"attn_implementation": "eager"}},
        # verl's reference adapter: the worker config wins over training_config
        {
            "ds_worker_config": {"attn_implementation": "eager"},
            "training_config": {"attn_implementation": "sdpa"},
        },
    ],
)
def test_attn_implementation_is_a_training_setting(legacy):
    config = ArcticRLClientConfig.model_validate({"model_name": "m", **legacy})
    assert config.training.attn_implementation == "eager"
    assert not any("attn_implementation" in key for key in config.ignored_settings)
    spec = config.to_create_job_request().sub_job_configs[0]
    engine = training_engine_config(spec, device="cpu", checkpoint_dir="/c", job_name="j")
    assert engine.model.attn_implementation == "eager"


def test_attn_implementation_is_honoured_by_the_training_model_load():
    from arctic_platform.engine.models import load_causal_lm

    for name in ("eager", "sdpa"):
        config = ArcticRLClientConfig.model_validate(
            {"model_name": "builtin:tiny", "ds_worker_config": {"attn_implementation": name}}
        )
        spec = config.to_create_job_request().sub_job_configs[0]
        engine = training_engine_config(spec, device="cpu", checkpoint_dir="/c", job_name="j")
        assert load_causal_lm(engine.model).config._attn_implementation == name


@pytest.mark.parametrize(
    ("legacy", "check"),
    [
        ({"backend": "local"}, lambda c: c.backend == HttpBackend(launch_local_server=True)),
        (
            {"backend": "local", "comm_protocol": "http", "host": "0.0.0.0", "port": 7001},
            lambda c: (
                (c.backend.host, c.backend.port, c.backend.launch_local_server)
                == ("0.0.0.0", 7001, True)
            ),
        ),
        (
            {"backend": "dss-platform", "host": "box", "port": 7000},
            lambda c: c.backend.base_url == "http://box:7000" and not c.backend.launch_local_server,
        ),
        (
            {"comm_protocol": "ray"},
            lambda c: c.backend.type == "ray" and c.legacy_backend == "local",
        ),
        (
            {
                "backend": {
                    "type": "onprem",
                    "protocol": "http",
                    "host": "h",
                    "port": 1,
                    "colocate": True,
                }
            },
            lambda c: (
                c.backend == HttpBackend(host="h", port=1)
                and c.ignored_settings == {"backend.colocate": True}
            ),
        ),
        (
            {
                "backend": {
                    "type": "remote",
                    "protocol": "cortex",
                    "base_url": "http://127.0.0.1:1",
                    "database": "D",
                    "schema": "S",
                }
            },
            lambda c: isinstance(c.backend, CortexBackend) and c.backend.schema_ == "S",
        ),
        (
            {"backend": "local", "launch_local_server": False, "startup_timeout": 30},
            lambda c: not c.backend.launch_local_server and c.backend.startup_timeout == 30,
        ),
        (
            {"backend": "onprem", "comm_protocol": "http", "launch_local_server": True},
            lambda c: c.backend.launch_local_server and c.legacy_backend is None,
        ),
        (
            {"backend": "http", "request_timeout": 5, "job_ready_timeout": 6},
            lambda c: (c.backend.request_timeout, c.backend.job_ready_timeout) == (5, 6),
        ),
        (
            {"training_gpus": 1, "sampling_gpus": 0, "log_prob_gpus": 3},
            lambda c: c.sampling is None and c.log_prob.n_gpus == 3 and c.training.n_gpus == 1,
        ),
        (
            {"training_gpus": 0, "sampling_gpus": 2},
            lambda c: c.training is None and c.sampling.n_gpus == 2,
        ),
        (
            {"max_seq_len": 512, "training_gpus": 1, "sampling_gpus": 1},
            lambda c: c.training.max_seq_len == 512 and c.sampling.max_seq_len == 512,
        ),
        (
            {
                "ds_config": {
                    "scheduler": {
                        "type": "WarmupCosineLR",
                        "params": {
                            "warmup_num_steps": 5,
                            "total_num_steps": 90,
                            "cos_min_ratio": 0.2,
                        },
                    }
                }
            },
            lambda c: (
                c.training.schedule.model_dump()
                == {"name": "cosine", "warmup_steps": 5, "total_steps": 90, "min_lr_ratio": 0.2}
            ),
        ),
        (
            {
                "training_config": {
                    "lr_scheduler": {"type": "linear", "warmup_ratio": 0.1},
                    "training_horizon": 40,
                    "dtype": "bfloat16",
                }
            },
            lambda c: (
                (
                    c.training.schedule.name,
                    c.training.schedule.warmup_steps,
                    c.training.schedule.total_steps,
                    c.training.dtype,
                )
                == ("linear", 4, 40, "bfloat16")
            ),
        ),
        (
            {"training_config": {"optimizer": {"gradient_clipping": 0.3}}},
            lambda c: c.training.optimizer.grad_clip == 0.3,
        ),
        (
            {
                "training": {
                    "ds_config": {"optimizer": {"params": {"lr": 3e-6}}},
                    "cuda_ipc": True,
                },
                "sampling": {"vllm": {"max_num_seqs": 4}},
                "training_gpus": 1,
                "sampling_gpus": 1,
            },
            lambda c: (
                c.training.optimizer.lr == 3e-6
                and c.sampling.vllm == {"max_num_seqs": 4}
                and c.ignored_settings == {"cuda_ipc": True}
            ),
        ),
        (
            {
                "training": {"optimizer": {"lr": 5e-6}},
                "ds_config": {"optimizer": {"params": {"lr": 1e-6}}},
            },
            lambda c: c.training.optimizer.lr == 5e-6,
        ),
        (
            {"training_job_id": 3, "sampling_job_id": "a:sampling:0"},
            lambda c: c.training_job_id == "3" and c.reconnecting,
        ),
        (
            {
                "cuda_ipc": True,
                "low_memory": True,
                "log_prob_ds_config": {},
                "ray_auto_attach": False,
                "health_check_interval": 1.0,
                "server_cuda_visible_devices": "0",
            },
            lambda c: (
                set(c.ignored_settings)
                == {
                    "cuda_ipc",
                    "low_memory",
                    "log_prob_ds_config",
                    "ray_auto_attach",
                    "health_check_interval",
                    "server_cuda_visible_devices",
                }
            ),
        ),
    ],
)
def test_each_legacy_field_folds(legacy, check):
    config = ArcticRLClientConfig.model_validate({"model_name": "m", **legacy})
    assert check(config), config


# -- environment override ---------------------------------------------------------------------

CORTEX_ENV = {
    "ARCTIC_RL_BACKEND": "cortex",
    "CORTEX_BASE_URL": "http://127.0.0.1:7000",
    "CORTEX_DATABASE": "DB",
    "CORTEX_SCHEMA": "RL",
    "CORTEX_ENDPOINT": "cortex-post-training",
    "CORTEX_PAT_ENV_VAR": "MY_PAT",
}


@pytest.fixture
def cortex_env(monkeypatch):
    for name, value in CORTEX_ENV.items():
        monkeypatch.setenv(name, value)


def test_env_override_rewrites_a_legacy_local_config(cortex_env, caplog):
    config = ArcticRLClientConfig.model_validate(SKYRL)
    with caplog.at_level(logging.INFO, logger="arctic_platform.client.factory"):
        rewritten = apply_env_override(config)
    assert rewritten.backend == CortexBackend(
        base_url="http://127.0.0.1:7000",
        database="DB",
        schema="RL",
        endpoint="cortex-post-training",
        pat_env_var="MY_PAT",
    )
    assert rewritten.training == config.training and rewritten.sampling == config.sampling
    assert "ARCTIC_RL_BACKEND=cortex" in caplog.text and "prefer `backend:`" in caplog.text


def test_env_override_rewrites_the_default_backend(cortex_env):
    assert isinstance(apply_env_override(ArcticRLClientConfig(model="m")).backend, CortexBackend)


def test_env_override_never_beats_an_explicit_backend(cortex_env, caplog):
    config = ArcticRLClientConfig(model="m", backend={"type": "inprocess"})
    with caplog.at_level(logging.INFO, logger="arctic_platform.client.factory"):
        assert apply_env_override(config) is config
    assert "ignored" in caplog.text
    http = ArcticRLClientConfig(model="m", backend={"type": "http", "url": "http://box:1"})
    assert apply_env_override(http) is http


def test_env_override_errors_name_the_variables(monkeypatch):
    monkeypatch.setenv("ARCTIC_RL_BACKEND", "cortex")
    monkeypatch.setenv("CORTEX_DATABASE", "DB")
    with pytest.raises(ValueError, match="CORTEX_BASE_URL, CORTEX_HOST"):
        apply_env_override(ArcticRLClientConfig(model="m"))
    monkeypatch.setenv("ARCTIC_RL_BACKEND", "carrier-pigeon")
    with pytest.raises(ValueError, match="ARCTIC_RL_BACKEND='carrier-pigeon'"):
        apply_env_override(ArcticRLClientConfig(model="m"))


def test_env_override_to_http_and_inprocess(monkeypatch):
    monkeypatch.setenv("ARCTIC_RL_BACKEND", "http")
    monkeypatch.setenv("ARCTIC_RL_HTTP_URL", "http://trainer:7000")
    monkeypatch.setenv("ARCTIC_RL_HTTP_TOKEN_ENV", "TOKEN")
    config = apply_env_override(
        ArcticRLClientConfig.model_validate({"model_name": "m", "backend": "local"})
    )
    assert config.backend == HttpBackend(url="http://trainer:7000", token_env="TOKEN")
    monkeypatch.setenv("ARCTIC_RL_BACKEND", "inprocess")
    legacy = ArcticRLClientConfig.model_validate({"model_name": "m", "backend": "local"})
    assert apply_env_override(legacy).backend == InProcessBackend()


def test_without_the_variable_nothing_changes(monkeypatch):
    monkeypatch.delenv("ARCTIC_RL_BACKEND", raising=False)
    config = ArcticRLClientConfig.model_validate(SKYRL)
    assert apply_env_override(config) is config


def test_cortex_auth_is_required_off_loopback(monkeypatch):
    monkeypatch.delenv("CORTEX_PAT", raising=False)
    remote = CortexBackend(host="acct.example.com", database="D", schema="S")
    with pytest.raises(ValueError, match="CORTEX_PAT"):
        remote.resolve_pat()
    local = CortexBackend(base_url="http://127.0.0.1:7000", database="D", schema="S")
    assert local.resolve_pat() is None
    monkeypatch.setenv("CORTEX_PAT", "tok")
    assert remote.resolve_pat() == "tok" and local.resolve_pat() == "tok"
    assert (
        CortexBackend(
            base_url="http://127.0.0.1:1", database="D", schema="S", auth="none"
        ).resolve_pat()
        is None
    )
    assert remote.prefix == "https://acct.example.com/api/v2/databases/D/schemas/S/cortex-training"
