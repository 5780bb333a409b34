"""The reference (legacy) config shapes fold the same way for the client and the on-prem server.

``JobsConfig`` (what ``/initialize`` validates a reference ``JobConfig`` as) and
``ArcticRLClientConfig`` (which adds the backend) must turn the same flat fields into the same
sub-job bodies and the same ignored settings; the server's copy needs no client module.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from arctic_platform.client.config import ArcticRLClientConfig
from arctic_platform.contract.job_sections import JobsConfig

REFERENCE = {
    "model_name": "builtin:tiny",
    "training_gpus": 2,
    "sampling_gpus": 1,
    "seed": 7,
    "ds_config": {
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
    },
    "ds_worker_config": {"max_token_len": 512, "use_liger": True},
    "vllm_config": {"max_num_seqs": 8},
    "checkpoint_path": "runs/a",
    "cuda_ipc": True,
}


def test_client_and_server_fold_a_reference_config_alike():
    server = JobsConfig.model_validate(REFERENCE)
    client = ArcticRLClientConfig.model_validate(REFERENCE)
    assert server.sub_job_configs() == client.sub_job_configs()
    assert server.ignored_settings == client.ignored_settings
    training = server.training
    assert training.n_gpus == 2 and training.max_tokens_per_microbatch == 512
    assert (training.optimizer.lr, training.optimizer.grad_clip) == (1e-3, 0.5)
    assert (training.schedule.name, training.schedule.warmup_steps) == ("constant", 3)
    assert training.checkpoint_dir == "runs/a"
    assert server.sampling.vllm["max_num_seqs"] == 8
    assert set(server.ignored_settings) == {
        "ds_config.zero_optimization",
        "ds_worker_config.use_liger",
        "cuda_ipc",
    }


@pytest.mark.parametrize(
    ("sent", "optimization"), [("memory", "memory"), ("compute", "memory"), (None, "none")]
)
def test_skyrl_logits_optimization_is_honoured_not_ignored(sent, optimization):
    """SkyRL puts its chunked-logits knobs in ds_worker_config (None: whole logits; the
    reference server's "compute" chunks by the same budget)."""
    worker = {
        **REFERENCE["ds_worker_config"],
        "logits_optimization": sent,
        "logits_optimization_peak_mem_size_in_gib": 4.0,
    }
    for config in (
        JobsConfig.model_validate({**REFERENCE, "ds_worker_config": worker}),
        ArcticRLClientConfig.model_validate({**REFERENCE, "ds_worker_config": worker}),
    ):
        logits = config.training.logits
        assert (logits.optimization, logits.peak_mem_size_in_gib) == (optimization, 4.0)
        assert not any("logits" in key for key in config.ignored_settings)
        body = next(s for s in config.sub_job_configs() if s["job_type"] == "training")
        assert body["training_config"]["logits"] == {
            "optimization": optimization,
            "peak_mem_size_in_gib": 4.0,
        }


def test_the_nested_logits_setting_wins_and_bad_values_are_named():
    worker = {"logits_optimization": "none", "logits_optimization_peak_mem_size_in_gib": 2}
    nested = {"logits": {"optimization": "memory"}}
    config = JobsConfig.model_validate(
        {**REFERENCE, "ds_worker_config": worker, "training": nested}
    )
    assert config.training.logits.optimization == "memory"
    assert config.training.logits.peak_mem_size_in_gib == 2
    with pytest.raises(ValidationError, match="training.logits.optimization"):
        JobsConfig.model_validate({**REFERENCE, "training": {"logits": {"optimization": "fast"}}})
    with pytest.raises(ValidationError, match="peak_mem_size_in_gib"):
        JobsConfig.model_validate(
            {**REFERENCE, "ds_worker_config": {"logits_optimization_peak_mem_size_in_gib": 0}}
        )


def test_bad_and_unknown_fields_are_named():
    with pytest.raises(ValidationError, match="training_gpus: expected an integer >= 0"):
        JobsConfig.model_validate({**REFERENCE, "training_gpus": -1})
    with pytest.raises(ValidationError, match="unknown field 'bogus' in JobsConfig"):
        JobsConfig.model_validate({**REFERENCE, "bogus": 1})
    with pytest.raises(ValidationError, match="model: required"):
        JobsConfig.model_validate({"training_gpus": 1})


def test_the_contract_folding_loads_no_client_module():
    code = (
        "import sys\n"
        "from arctic_platform.contract.job_sections import JobsConfig\n"
        f"JobsConfig.model_validate({REFERENCE!r}).sub_job_configs()\n"
        "print(sorted(m for m in sys.modules if m.startswith('arctic_platform.client')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
