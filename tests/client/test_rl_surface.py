"""``arctic_platform.rl``: the names frameworks import, the same objects as the client's."""

from __future__ import annotations

import pytest

import arctic_platform.client as client
import arctic_platform.rl as rl


def test_rl_names_are_the_clients():
    assert rl.create_arctic_rl_client is client.create_arctic_rl_client
    assert rl.ArcticRLClientConfig is client.ArcticRLClientConfig
    assert rl.ArcticRLClient is client.ArcticRLClient
    assert rl.SyncArcticRLClient is client.SyncArcticRLClient
    assert {"create_arctic_rl_client", "ArcticRLClientConfig", "processors"} <= set(dir(rl))
    with pytest.raises(AttributeError, match="no attribute 'create_client'"):
        rl.create_client  # noqa: B018


def test_verl_grpo_processor_is_the_registered_loss():
    from arctic_platform.engine.losses import get_loss
    from arctic_platform.rl.processors import verl_grpo

    assert verl_grpo.LOSS_NAME == "verl_grpo"
    assert get_loss(verl_grpo.LOSS_NAME) is verl_grpo.VerlGrpoLoss
    assert rl.processors.verl_grpo is verl_grpo
    config = verl_grpo.parse_actor_config({"clip_ratio_low": 0.1, "clip_ratio_high": 0.3}, {})
    assert isinstance(config, verl_grpo.ActorLossConfig)
    assert (config.clip_ratio_low, config.clip_ratio_high) == (0.1, 0.3)
