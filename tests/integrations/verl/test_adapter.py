"""The adapter: client config from verl's config and ``arctic.yaml``, the handle, the lifecycle."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from arctic_platform.client import ArcticRLError
from arctic_platform.client.factory import apply_env_override
from tests.integrations.verl.conftest import inprocess_overrides

KL = "actor_rollout_ref.actor.use_kl_loss=true"


@pytest.fixture(scope="module")
def kl_config(compose_verl, tmp_path_factory):
    return compose_verl(*inprocess_overrides(tmp_path_factory.mktemp("adapter")), KL)


@pytest.fixture(scope="module")
def driver(kl_config):
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper

    backend = ArcticRLClientWrapper.from_config(kl_config)
    yield backend
    backend.destroy()


def client_config_of(main_config):
    from arctic_platform.integrations.verl.verl_config import client_config, read_settings

    return client_config(main_config, read_settings(main_config))


def test_from_config_creates_the_jobs_verl_needs(driver, kl_config):
    assert driver.owner
    jobs = driver.client.jobs
    assert None not in (jobs.training, jobs.sampling, jobs.log_prob)
    assert driver.requires_single_forwarder() is True
    assert driver.actor_config["use_kl_loss"] is True
    assert driver.policy_loss_config == {"loss_mode": "vanilla"}

    config = client_config_of(kl_config)
    assert (config.model, config.seed, config.backend.type) == ("builtin:tiny", 42, "inprocess")
    training = config.training
    assert training.max_seq_len == 8 + 6  # data.max_prompt_length + max_response_length
    assert training.train_batch_size == 1 * 4  # ppo_mini_batch_size x rollout.n
    assert training.optimizer.lr == pytest.approx(0.003)
    assert training.optimizer.betas == (0.9, 0.999)
    assert training.optimizer.grad_clip == 1.0  # verl's optim.clip_grad
    assert training.max_tokens_per_microbatch == 16384  # actor.ppo_max_token_len_per_gpu
    assert training.gradient_checkpointing is True  # model.enable_gradient_checkpointing
    assert config.sampling.max_batch_size == 256  # rollout.max_num_seqs
    assert config.log_prob is not None


def test_the_reference_job_follows_verls_need(compose_verl):
    assert client_config_of(compose_verl()).log_prob is None
    assert client_config_of(compose_verl("algorithm.use_kl_in_reward=true")).log_prob is not None
    forced = compose_verl("remote_backend.arctic.log_prob.enable=true")
    assert client_config_of(forced).log_prob is not None
    off = compose_verl(KL, "remote_backend.arctic.log_prob.enable=false")
    assert client_config_of(off).log_prob is None


def test_schedule_counts_optimizer_updates(compose_verl):
    config = client_config_of(
        compose_verl(
            "actor_rollout_ref.actor.ppo_epochs=2",
            "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
            "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
            "trainer.total_training_steps=10",
        )
    )
    schedule = config.training.schedule
    # 2 epochs x (train_batch_size 2 / ppo_mini_batch_size 1) = 4 updates per verl step.
    assert (schedule.name, schedule.warmup_steps, schedule.total_steps) == ("cosine", 4, 40)
    assert schedule.min_lr_ratio == pytest.approx(0.1)
    with pytest.raises(ValueError, match="trainer.total_training_steps"):
        client_config_of(compose_verl("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"))


def test_lora_comes_from_verls_model_keys(compose_verl):
    lora = client_config_of(
        compose_verl("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32")
    ).training.lora
    assert (lora.r, lora.alpha, lora.target_modules) == (8, 32.0, "all-linear")


def test_backend_choice_comes_from_the_yaml(compose_verl, monkeypatch):
    monkeypatch.delenv("ARCTIC_RL_BACKEND", raising=False)
    http = client_config_of(compose_verl()).backend  # the yaml's default
    assert (http.type, http.launch_local_server, http.port) == ("http", True, 0)
    ray = client_config_of(
        compose_verl("remote_backend.arctic.backend=ray", "remote_backend.arctic.ray.address=local")
    ).backend
    assert (ray.type, ray.address) == ("ray", "local")
    cortex = client_config_of(
        compose_verl(
            "remote_backend.arctic.backend=cortex",
            "remote_backend.arctic.cortex.base_url=http://127.0.0.1:7000",
            "remote_backend.arctic.cortex.database=DB",
            "remote_backend.arctic.cortex.schema=SC",
        )
    ).backend
    assert cortex.prefix == "http://127.0.0.1:7000/api/v2/databases/DB/schemas/SC/cortex-training"


def test_a_null_backend_leaves_the_choice_to_the_environment_fallback(compose_verl, monkeypatch):
    config = client_config_of(compose_verl("remote_backend.arctic.backend=null"))
    assert config.backend.type == "inprocess"
    monkeypatch.setenv("ARCTIC_RL_BACKEND", "http")
    monkeypatch.setenv("ARCTIC_RL_HTTP_URL", "http://trainer-box:7000")
    assert apply_env_override(config).backend.base_url == "http://trainer-box:7000"
    explicit = client_config_of(compose_verl("remote_backend.arctic.backend=inprocess"))
    assert apply_env_override(explicit).backend.type == "inprocess"  # the yaml's choice wins


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("remote_backend.arctic.training.n_gpus=0", "remote_backend.arctic.training.n_gpus"),
        ("+remote_backend.arctic.trainig={}", "remote_backend.arctic.trainig"),
        ("remote_backend.arctic.backend=local", "remote_backend.arctic.backend"),
        ("remote_backend.arctic.checkpoints=s3", "remote_backend.arctic.checkpoints"),
        ("+remote_backend.arctic.http.prot=7000", "unknown field 'prot'"),
        ("remote_backend.arctic.backend=cortex", "arctic.cortex: .*base_url or host"),
    ],
)
def test_bad_arctic_settings_name_the_key(compose_verl, override, message):
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper

    with pytest.raises(ValueError, match=message):
        ArcticRLClientWrapper.from_config(compose_verl(override))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.name"),
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
        ),
        (
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
            "actor_rollout_ref.actor.policy_loss.loss_mode",
        ),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=3", "ppo_mini_batch_size"),
        (
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
            "actor_rollout_ref.rollout.checkpoint_engine.backend",
        ),
        ("trainer.n_gpus_per_node=8", "trainer.n_gpus_per_node"),
        ("actor_rollout_ref.actor.optim.lr_scheduler_type=wsd", "lr_scheduler_type"),
    ],
)
def test_verl_settings_it_cannot_honour_name_the_key(compose_verl, tmp_path, override, key):
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper

    config = compose_verl(*inprocess_overrides(tmp_path), override)
    with pytest.raises(ValueError, match=key):
        ArcticRLClientWrapper.from_config(config)
    assert not any(tmp_path.iterdir())  # refused before any job was created


def test_without_the_arctic_group_the_error_says_how_to_choose_it(compose_verl):
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper

    with pytest.raises(ValueError, match=r"remote_backend.arctic: missing.*hydra.searchpath"):
        ArcticRLClientWrapper.from_config(compose_verl(arctic=False))


def test_reconnect_handle_round_trip(driver, kl_config):
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper

    handle = driver.reconnect_handle()
    json.dumps(handle["rl_client_reconnect_config"])  # plain data, for verl's worker kwargs
    attached = ArcticRLClientWrapper.from_config(kl_config, handle=handle)
    assert not attached.owner
    assert attached.client.jobs == driver.client.jobs
    assert asyncio.run(attached.update_weights(mode="naive"))  # an op through the attached copy

    attached.destroy()
    attached.destroy()  # idempotent
    with pytest.raises(ArcticRLError, match="destroyed"):
        asyncio.run(attached.update_weights())
    assert asyncio.run(driver.update_weights())  # the attached copy did not release the jobs


@pytest.mark.parametrize(
    ("handle", "error", "message"),
    [
        ([1, 2], TypeError, "handle: expected the dict"),
        ({}, ValueError, "rl_client_reconnect_config"),
    ],
)
def test_bad_handles_are_refused(kl_config, handle, error, message):
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper

    with pytest.raises(error, match=message):
        ArcticRLClientWrapper.from_config(kl_config, handle=handle)


def test_update_weights_refuses_modes_it_cannot_serve(driver):
    with pytest.raises(ValueError, match="mode: .*'nccl'"):
        asyncio.run(driver.update_weights(mode="nccl"))


def test_checkpoints_go_under_verls_folder(driver, tmp_path):
    folder = tmp_path / "global_step_3" / "actor"
    saved = asyncio.run(driver.save_checkpoint(str(folder)))
    assert Path(saved["path"]).parent == folder
    assert (Path(saved["path"]) / "optimizer.pt").exists()
    loaded = asyncio.run(driver.load_checkpoint(str(folder)))
    assert loaded["global_step"] == saved["global_step"]


def test_the_owner_releases_the_jobs_on_destroy(compose_verl, tmp_path):
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper

    config = compose_verl(*inprocess_overrides(tmp_path))
    owner = ArcticRLClientWrapper.from_config(config)
    attached = ArcticRLClientWrapper.from_config(config, handle=owner.reconnect_handle())
    owner.destroy()
    owner.destroy()
    with pytest.raises(ArcticRLError):
        asyncio.run(attached.update_weights())


def test_server_checkpoints_stay_in_the_servers_folder(driver, kl_config, compose_verl, tmp_path):
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper

    config = compose_verl(KL, "remote_backend.arctic.checkpoints=server")
    attached = ArcticRLClientWrapper.from_config(config, handle=driver.reconnect_handle())
    try:
        verl_folder = tmp_path / "global_step_1" / "actor"
        saved = asyncio.run(attached.save_checkpoint(str(verl_folder), max_ckpt_to_keep=1))
        assert not verl_folder.exists()
        data_dir = Path(kl_config.remote_backend.arctic.inprocess.data_dir)
        assert Path(saved["path"]).is_relative_to(data_dir)
    finally:
        attached.destroy()
