"""The JSON body of every op, as pydantic models that forbid unknown keys.

The server validates each body against its model before anything runs (a typo is a 400 naming the
key); :mod:`arctic_platform.contract.ops` names which model each op takes. Tensor envelopes
(forward-backward, forward) are described by :data:`TRAIN_ENVELOPE_KEYS` and
:data:`SNOWAPI_ENVELOPE_KEYS`, which the client checks before sending and the server on receipt.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

# The tensor envelope of forward-backward / forward: the on-prem (verl) form and the SnowAPI form.
TRAIN_ENVELOPE_KEYS = frozenset({"batch", "meta", "processing", "router_replay", "reference_model"})
SNOWAPI_ENVELOPE_KEYS = frozenset(
    {"args", "kwargs", "context", "meta", "processing", "reference_model"}
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepBody(_Body):
    learning_rate: float | None = Field(None, gt=0.0)


class SaveBody(_Body):
    checkpoint_id: str | None = None
    checkpoint_type: Literal["resumable", "weights-only"] = "resumable"
    path: str | None = None
    step: NonNegativeInt | None = None
    export_hf: bool = False
    save_total_limit: NonNegativeInt | None = None
    stage_info: dict[str, Any] | None = None


class LoadBody(_Body):
    """On-prem form ``{path, step}`` or Cortex form ``{checkpoint_id, source_job_id?}``."""

    path: str | None = None
    step: NonNegativeInt | None = None
    checkpoint_id: str | None = None
    source_job_id: str | None = None
    target_sub_job_id: str | None = None


class GenerateBody(_Body):
    prompts: list[str | list[int]] = Field(min_length=1)
    sampling_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    routing_key: Any = None
    strict: bool = False


class LogProbsBody(_Body):
    prompts: list[str | list[int]] = Field(min_length=1)
    completions: list[str | list[int]] | None = None
    top_k: NonNegativeInt = 1


class WeightSyncBody(_Body):
    source_sub_job_id: str | int | None = None
    target_sub_job_ids: list[str | int] = Field(min_length=1)
    cuda_ipc: bool | None = None
    low_memory: bool | None = None
    weight_format: Literal["vllm", "hf", "lora"] | None = None


class ResetPrefixCacheBody(_Body):
    drain: bool = True
    timeout_s: float = Field(60.0, gt=0.0)
    retry_interval_s: float = Field(0.1, gt=0.0)


class SleepInferenceBody(_Body):
    level: int = Field(1, ge=1, le=2)


class SleepTrainingBody(_Body):
    mode: Literal["all", "non_lp", "lp_params"] = "all"


class EmptyBody(_Body):
    pass


class CancelRequestBody(_Body):
    request_id: str = Field(min_length=1)


class TailLogsBody(_Body):
    cursor: str | int | None = None
    max_lines: int = Field(200, ge=1, le=10_000)


class OperationBody(_Body):
    operation_type: str = Field(min_length=1)
    sub_job_id: str | int | None = None
    sub_job_type: str | None = None
    payload: dict[str, Any] = Field(default_factory=dict)
