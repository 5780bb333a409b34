"""One job-config schema at every edge: the same bad config gets the same 400 naming the field
from the client config, the on-prem ``/initialize`` route and the Cortex create-job route, before
any job exists; the Cortex spellings and ours are one setting with one default."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from arctic_platform.client import ArcticRLClientConfig
from arctic_platform.contract.job_config import TrainingSettings
from arctic_platform.contract.settings import LoraConfig
from tests.server.conftest import CORTEX, TINY

NEEDS_TOTAL_STEPS = "total_steps: the cosine schedule needs it"


def server_replies(http, training: dict) -> list:
    """The Cortex create-job route's and the on-prem ``/initialize`` route's answers to a
    training sub-job with ``training`` as its config."""
    sub_job = {"job_type": "training", "model_name": TINY, "training_config": training}
    return [
        http.post(CORTEX, json={"sub_job_configs": [sub_job]}),
        http.post("/initialize", json=sub_job),
    ]


def test_a_schedule_without_total_steps_is_refused_by_every_edge_before_a_job_exists(http):
    training = {"optimizer": {"lr": 1e-3}, "lr_scheduler": {"name": "cosine"}}
    for reply in server_replies(http, training):
        assert reply.status_code == 400
        assert "training_config.lr_scheduler" in reply.json()["message"]
        assert NEEDS_TOTAL_STEPS in reply.json()["message"]
    assert http.get(CORTEX).json()["jobs"] == []
    with pytest.raises(ValidationError, match=f"(?s)training.schedule.*{NEEDS_TOTAL_STEPS}"):
        ArcticRLClientConfig.model_validate(
            {"model": TINY, "training": {"schedule": {"name": "cosine"}}}
        )


def test_a_non_boolean_train_unembed_is_refused_by_every_edge_before_a_job_exists(http):
    training = {"peft_config": {"peft_type": "Lora", "r": 4, "train_unembed": "maybe"}}
    for reply in server_replies(http, training):
        assert reply.status_code == 400, reply.text
        assert "training_config.peft_config.train_unembed" in reply.json()["message"]
    assert http.get(CORTEX).json()["jobs"] == []
    with pytest.raises(ValidationError, match=r"(?s)training\.lora\.train_unembed.*boolean"):
        ArcticRLClientConfig.model_validate(
            {"model": TINY, "training": {"lora": {"train_unembed": "maybe"}}}
        )


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_a_seed_torch_cannot_take_is_refused_by_every_edge_before_a_job_exists(http, seed):
    """It was accepted, and the job failed once built ('Overflow when unpacking long long')."""
    sub_job = {"job_type": "training", "model_name": TINY, "seed": seed}
    for reply in (
        http.post(CORTEX, json={"sub_job_configs": [sub_job]}),
        http.post("/initialize", json=sub_job),
    ):
        assert reply.status_code == 400, reply.text
        assert reply.json()["field"].endswith("seed"), reply.text
    assert http.get(CORTEX).json()["jobs"] == []
    with pytest.raises(ValidationError, match="seed"):
        ArcticRLClientConfig.model_validate({"model": TINY, "seed": seed})
    ArcticRLClientConfig.model_validate({"model": TINY, "seed": 2**64 - 1})  # the largest


def test_cortex_names_and_ours_are_one_setting():
    ours = TrainingSettings.model_validate(
        {
            "optimizer": {"lr": 1e-4, "grad_clip": 0.3},
            "schedule": {"name": "linear", "total_steps": 9},
            "gradient_checkpointing": True,
            "lora": {"r": 4, "alpha": 2.0},
        }
    )
    cortex = TrainingSettings.model_validate(
        {
            "optimizer": {"name": "AdamW", "lr": 1e-4},
            "gradient_clipping": 0.3,
            "lr_scheduler": {"name": "linear", "total_steps": 9},
            "activation_checkpointing": True,
            "peft_config": {"peft_type": "Lora", "r": 4, "lora_alpha": 2.0},
        }
    )
    assert ours == cortex
    wire = ours.model_dump(by_alias=True)
    assert wire["gradient_clipping"] == 0.3 and "grad_clip" not in wire["optimizer"]
    assert {"lr_scheduler", "activation_checkpointing", "peft_config"} <= set(wire)
    assert TrainingSettings.model_validate(wire) == ours
    with pytest.raises(ValidationError, match="gradient_clipping: 0.5 disagrees"):
        TrainingSettings.model_validate({"gradient_clipping": 0.5, "optimizer": {"grad_clip": 1}})


def test_lora_has_one_default_everywhere():
    client = ArcticRLClientConfig.model_validate({"model": TINY, "training": {"lora": {}}})
    server = TrainingSettings.model_validate({"peft_config": {"peft_type": "Lora"}})
    assert client.training.lora == server.lora == LoraConfig()
    assert (LoraConfig().r, LoraConfig().alpha) == (8, 8.0)  # the Cortex API's defaults
