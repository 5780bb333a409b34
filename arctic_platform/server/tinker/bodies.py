"""The JSON request bodies the Tinker SDK sends, as pydantic models.

Field names and defaults are the SDK's (``tinker.types``). Unknown keys are ignored, because the
SDK adds fields across versions (``type`` tags, telemetry hints) that carry no meaning here; a
wrong type on a known field is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt

from arctic_platform.contract.settings import Seed


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class SessionBody(_Body):
    session_id: str


# LoRA adapters of rank r add r x (in + out) parameters to each adapted d_in x d_out layer, and
# the engine allocates them (and their Adam state) when the job starts: an unbounded rank is an
# unbounded allocation. 1024 is 32 x Tinker's default rank of 32 and a quarter of a 7B-class
# model's hidden size (4096): adapters of at most half the size of the layers they adapt there.
MAX_LORA_RANK = 1024


class LoraConfig(_Body):
    rank: int = Field(ge=1, le=MAX_LORA_RANK)
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(_Body):
    type: str = "adamw"


class CreateModelBody(_Body):
    session_id: str
    model_seq_id: int
    base_model: str = Field(min_length=1)
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = OptimizerConfig()


class ModelBody(_Body):
    model_id: str


class AdamParams(_Body):
    learning_rate: NonNegativeFloat = 1e-4
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-12, gt=0.0)
    weight_decay: NonNegativeFloat = 0.0
    grad_clip_norm: NonNegativeFloat = 0.0


class OptimStepBody(_Body):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsBody(_Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    overwrite: bool = False
    ttl_seconds: int | None = None


class SaveForSamplerBody(_Body):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None


class LoadWeightsBody(_Body):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    path: str
    optimizer: bool


class CreateSamplingSessionBody(_Body):
    session_id: str
    sampling_session_seq_id: int
    model_path: str | None = None
    base_model: str | None = None


class Chunk(_Body):
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list)


class ModelInput(_Body):
    chunks: list[Chunk]


class SamplingParams(_Body):
    max_tokens: PositiveInt | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: NonNegativeFloat = 1.0
    top_k: int = -1
    top_p: float = Field(1.0, gt=0.0, le=1.0)


class SampleBody(_Body):
    num_samples: PositiveInt = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0


class RetrieveBody(_Body):
    request_id: str


class FinishBody(_Body):
    reason: dict[str, Any] | None = None
    detail: str | None = None


class TtlBody(_Body):
    ttl_seconds: int | None = None


class WeightsInfoBody(_Body):
    tinker_path: str
