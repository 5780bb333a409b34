"""The ``arctic`` rollout: verl's sampling parameters, the token server's lifecycle, the replica."""

from __future__ import annotations

import asyncio

import pytest

from tests.integrations.verl.conftest import inprocess_overrides

VERL_PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def setup(compose_verl, tmp_path_factory):
    from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper

    config = compose_verl(*inprocess_overrides(tmp_path_factory.mktemp("rollout")))
    driver = ArcticRLClientWrapper.from_config(config)
    yield config, driver
    driver.destroy()


@pytest.fixture
def server(setup):
    from arctic_platform.integrations.verl.rollout import ArcticRolloutReplica, ArcticTokenServer

    config, driver = setup
    replica = ArcticRolloutReplica(
        0,
        config.actor_rollout_ref.rollout,
        config.actor_rollout_ref.model,
        main_config=config,
        backend_handle=driver.reconnect_handle(),
    )
    return ArcticTokenServer(**replica.server_kwargs())


def test_verls_sampling_params_become_the_engines(remote_backend):
    from arctic_platform.integrations.verl.rollout import sampling_params_for_engines

    def convert(params, prompt_len=4, max_model_len=None):
        return sampling_params_for_engines(
            params, prompt_len=prompt_len, response_length=6, max_model_len=max_model_len
        )

    assert convert({**VERL_PARAMS, "logprobs": True}) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "logprobs": 0,
        "max_tokens": 6,  # rollout.response_length
    }
    assert "logprobs" not in convert({**VERL_PARAMS, "logprobs": False})
    assert convert({"max_new_tokens": 3})["max_tokens"] == 3
    assert convert({"max_tokens": 9}, prompt_len=5, max_model_len=10)["max_tokens"] == 5
    with pytest.raises(ValueError, match="sampling_params.repetition_penalty"):
        convert({"repetition_penalty": 1.1})
    with pytest.raises(ValueError, match="sampling_params.n"):
        convert({"n": 2})
    with pytest.raises(ValueError, match="prompt_ids: 11 tokens exceed max_model_len"):
        convert({}, prompt_len=11, max_model_len=10)


def test_generate_answers_with_a_token_output(server):
    out = asyncio.run(
        server.generate([40, 41, 42], {**VERL_PARAMS, "logprobs": True, "seed": 3}, "r-1")
    )
    assert 1 <= len(out.token_ids) <= 6
    assert len(out.log_probs) == len(out.token_ids) and all(lp <= 0 for lp in out.log_probs)
    assert out.stop_reason == "completed"
    assert out.extra_fields == {"global_steps": None}
    asyncio.run(server.set_global_steps(7))
    again = asyncio.run(server.generate([40, 41], dict(VERL_PARAMS), "r-2"))
    assert again.log_probs is None and again.extra_fields["global_steps"] == 7
    with pytest.raises(ValueError, match="image_data: the arctic rollout serves text models"):
        asyncio.run(server.generate([40], dict(VERL_PARAMS), "r-3", image_data=[b"png"]))


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        ({"audio_data": [b"wav"]}, ValueError, "audio_data: the arctic rollout serves text"),
        ({"mm_processor_kwargs": {"fps": 2}}, ValueError, "mm_processor_kwargs: the arctic"),
        ({"video_data": [b"mp4"], "audio_data": [b"x"]}, ValueError, "video_data, audio_data"),
        ({"beam_width": 2}, TypeError, r"unexpected keyword arguments \['beam_width'\]"),
    ],
)
def test_generate_refuses_multimodal_input_and_unknown_keywords(server, extra, error, message):
    with pytest.raises(error, match=message):
        asyncio.run(server.generate([40], dict(VERL_PARAMS), "r-4", **extra))


def test_generate_takes_the_keywords_verls_server_manager_passes(server):
    """verl's LLM server manager passes empty multimodal fields and a priority."""
    out = asyncio.run(
        server.generate(
            prompt_ids=[40, 41],
            sampling_params=dict(VERL_PARAMS),
            request_id="r-5",
            image_data=None,
            video_data=None,
            audio_data=None,
            mm_processor_kwargs={},
            priority=1,
        )
    )
    assert out.stop_reason == "completed" and out.token_ids


def test_paused_generation_waits_for_resume_or_is_rejected(server, monkeypatch):
    sent = []
    send = server.backend.generate

    async def recording(*args, **kwargs):
        sent.append(args)
        return await send(*args, **kwargs)

    monkeypatch.setattr(server.backend, "generate", recording)

    async def scenario():
        await server.abort_all_requests()
        waiting = asyncio.create_task(server.generate([40, 41], dict(VERL_PARAMS), "held"))
        await asyncio.sleep(0)  # the task runs until it waits: up to the send, if not held
        held = not sent and not waiting.done()
        await server.resume_generation()
        out = await asyncio.wait_for(waiting, timeout=60)
        await server.abort_all_requests(reject_request=True)
        try:
            await server.generate([40], dict(VERL_PARAMS), "rejected")
        except RuntimeError as exc:
            rejected = str(exc)
        await server.resume_generation()
        return held, out, rejected

    held, out, rejected = asyncio.run(scenario())
    assert held and out.token_ids
    assert "generation is paused" in rejected


def test_sleep_and_wake_release_and_restore_the_kv_cache(server):
    asyncio.run(server.sleep())
    asyncio.run(server.wake_up())
    asyncio.run(server.release_kv_cache())
    asyncio.run(server.resume_kv_cache())
    asyncio.run(server.clear_kv_cache())
    out = asyncio.run(server.generate([40, 41], dict(VERL_PARAMS), "after-wake"))
    assert out.token_ids


def test_the_replica_needs_the_trainers_kwargs(setup):
    from arctic_platform.integrations.verl.rollout import ArcticRolloutReplica

    config, driver = setup
    rollout, model = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    with pytest.raises(ValueError, match="main_config, backend_handle"):
        ArcticRolloutReplica(0, rollout, model)
    with pytest.raises(ValueError, match="serves the policy"):
        ArcticRolloutReplica(
            0,
            rollout,
            model,
            is_reward_model=True,
            main_config=config,
            backend_handle=driver.reconnect_handle(),
        )
    replica = ArcticRolloutReplica(
        0, rollout, model, main_config=config, backend_handle=driver.reconnect_handle()
    )
    assert replica.rollout_worker_use_gpu() is False
    assert replica.world_size == 1
    kwargs = replica.server_kwargs()
    # data.max_response_length; data.max_prompt_length + max_response_length
    assert (kwargs["response_length"], kwargs["max_model_len"]) == (6, 14)
