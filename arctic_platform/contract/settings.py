"""The engine settings every job-config schema is built from: optimizer, schedule, LoRA.

One definition per setting, with its one default and its validators: the engines use these models
(:mod:`arctic_platform.engine.config` composes them), the server's sub-job config composes them
under the Cortex API's names (:mod:`arctic_platform.contract.job_config`), and the client's YAML
config composes that. So a bad value is rejected with the same message, naming the same field,
wherever it enters (client config, on-prem ``/initialize``, Cortex create-job), before any job
exists.

Only pydantic is needed: the client imports these without torch.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)


def did_you_mean(name: object, candidates: set[str]) -> str:
    """`` (did you mean 'lr'?)`` for the closest candidate, or ``""`` when none is close."""
    close = difflib.get_close_matches(str(name), sorted(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_field_message(
    names: list[str], known: set[str], where: str, shown: set[str] | None = None
) -> str:
    """``unknown field 'lrr' in OptimizerConfig (did you mean 'lr'?); known fields: ...``.

    Suggestions come from ``known``; the listing shows ``shown`` (default: ``known``).
    """
    parts = [f"unknown field {name!r} in {where}{did_you_mean(name, known)}" for name in names]
    listing = ", ".join(sorted(known if shown is None else shown))
    return "; ".join(parts) + f"; known fields: {listing}"


class Settings(BaseModel):
    """A settings model: unknown keys are errors that suggest the closest known key; a field's
    name and its aliases are all accepted."""

    # Infinite or NaN numbers mean nothing in a setting: in JSON they travel as null and an
    # infinite learning rate reached the server as "lr: None".
    model_config = ConfigDict(
        extra="forbid", validate_default=True, populate_by_name=True, allow_inf_nan=False
    )
    # Foreign keys a model accepts without acting on them (see job_config's passthrough).
    passthrough_keys: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def known_keys(cls) -> set[str]:
        keys = set(cls.model_fields)
        for info in cls.model_fields.values():
            if info.alias:
                keys.add(info.alias)
            if isinstance(info.validation_alias, AliasChoices):
                keys.update(c for c in info.validation_alias.choices if isinstance(c, str))
            elif isinstance(info.validation_alias, str):
                keys.add(info.validation_alias)
        return keys | cls.passthrough_keys

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = [k for k in data if k not in cls.known_keys()]
            if unknown:
                known = cls.known_keys()
                shown = known - cls.passthrough_keys
                raise ValueError(unknown_field_message(unknown, known, cls.__name__, shown))
        return data


class LoraConfig(Settings):
    """Low-rank adapters through peft; only the adapter weights train (weight sync merges them).

    The Cortex API spells it ``peft_config`` with ``peft_type: Lora``, ``lora_alpha`` and
    ``lora_dropout``; both spellings are accepted. ``r`` and ``alpha`` default to 8, the Cortex
    API's defaults. ``train_unembed`` also adapts the output layer (the unembedding, which
    ``all-linear`` leaves out), as Tinker's LoRA does by default; a model whose output layer
    shares the input embedding's weights trains without it, reported in the job's
    ``ignored_settings``.
    """

    peft_type: Literal["Lora", "LORA", "lora"] = "Lora"
    r: PositiveInt = 8
    alpha: float = Field(8.0, gt=0.0, validation_alias=AliasChoices("alpha", "lora_alpha"))
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, validation_alias=AliasChoices("dropout", "lora_dropout")
    )
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    train_unembed: bool = False


class OptimizerConfig(Settings):
    """AdamW hyper-parameters and gradient clipping (``grad_clip <= 0`` disables clipping).

    ``name`` takes the Cortex API's spellings (``AdamW``, ``adamw``, ``Adam``, ``adam``); every
    one of them is AdamW with ``weight_decay`` (0 by default).
    """

    name: Literal["AdamW", "adamw", "Adam", "adam"] = "AdamW"
    lr: float = Field(1e-5, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = 1.0


class SchedulerConfig(Settings):
    """Learning-rate schedule: linear warmup, then constant, linear or cosine decay.

    ``total_steps`` is required by the decaying schedules; ``min_lr_ratio`` is the floor they
    decay to, as a fraction of the peak learning rate.
    """

    name: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: PositiveInt | None = None
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _decay_needs_total_steps(self) -> SchedulerConfig:
        if self.name != "constant" and self.total_steps is None:
            raise ValueError(f"total_steps: the {self.name} schedule needs it")
        return self


SamplingEngineName = Literal["torch", "vllm"]
# A job's random seed: what ``torch.manual_seed`` takes, a 64-bit integer signed or not (a seed
# beyond it failed the job once built, 'Overflow when unpacking long long').
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
# Whether rows that share a prompt compute it once (arctic_platform.engine.prompt_sharing).
PromptSharing = Literal["auto", "off"]
# Whether the LM head scores tokens in chunks (arctic_platform.engine.chunked_head).
LogitsOptimization = Literal["memory", "none"]
# Other clients' spellings of LogitsOptimization: SkyRL's None (whole logits) and the reference
# server's "compute" (rows chunked by the same budget).
_LOGITS_OPTIMIZATION_SPELLINGS = {None: "none", "compute": "memory"}


class LogitsSettings(Settings):
    """How log-probs, entropies and losses go through the LM head (``training.logits``; verl's
    ``arctic_rl.train.logits``, and SkyRL's ``ds_worker_config.logits_optimization*`` fold in here).

    ``optimization: memory`` (the default) never materialises a microbatch's whole
    ``[tokens x vocabulary]`` float32 logits when they would not fit ``peak_mem_size_in_gib``: the
    head then runs over chunks of token rows sized from that budget and the vocabulary, in forward
    and backward (:mod:`arctic_platform.engine.chunked_head`); when they fit (small vocabularies,
    small microbatches) the whole logits are computed, which is faster. ``none`` always computes
    the whole logits. Results agree to float rounding either way. SkyRL's ``None`` is ``none``
    and the reference server's ``compute`` is ``memory``.

    The 0.5 GiB default keeps the head's peak well under the weights' and optimizer's memory
    from ~0.2 B parameters up (16 bytes a parameter in float32: 3.5 GB at 0.2 B), while chunks
    stay hundreds of rows long at a 152 k vocabulary (441 rows), so the head's matrix products
    stay efficient; SkyRL sends 4.
    """

    optimization: LogitsOptimization = "memory"
    peak_mem_size_in_gib: PositiveFloat = Field(
        0.5,
        validation_alias=AliasChoices("peak_mem_size_in_gib", "optimization_peak_mem_size_in_gib"),
    )

    @field_validator("optimization", mode="before")
    @classmethod
    def _fold_spellings(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return _LOGITS_OPTIMIZATION_SPELLINGS.get(value, value)
        return value

    @property
    def peak_bytes(self) -> int:
        """The budget in bytes."""
        return int(self.peak_mem_size_in_gib * 2**30)


class VllmSettings(BaseModel):
    """How the vLLM sampling engine runs (``sampling.vllm``; the legacy ``vllm_config``).

    ``python`` is the interpreter of the environment that has vLLM (default:
    ``$ARCTIC_VLLM_PYTHON``, else this interpreter when it can import vllm). ``weight_sync`` picks
    how synced weights reach the running engine: ``restart`` builds a new vLLM engine on them,
    ``reload`` loads them into the running one (both from staged files), ``ipc`` / ``nccl`` send
    them through vLLM's weight-transfer engine (CUDA only, untested on GPU), ``auto`` reloads on
    CPU and uses ``ipc`` on CUDA, falling back to ``reload`` if that transfer fails.
    ``env`` adds environment variables for the vLLM process (``VLLM_CPU_KVCACHE_SPACE``, ...).
    Every other key is a vLLM engine argument (``enforce_eager``, ``gpu_memory_utilization``, ...),
    checked against the installed vLLM when the engine starts; ``max_num_seqs`` and
    ``max_model_len`` also bound our own sampler, ``kv_cache_memory_bytes`` is its KV budget
    too (``max_kv_cache_bytes``: the running batch's cache and, in what that leaves, the prompt
    cache), and ``enable_prefix_caching: false`` also turns off its prompt cache
    (``engine/prompt_cache.py``). On CPU vLLM's KV cache is sized from the job
    (``max_num_seqs`` x ``max_model_len``; see ``engine/vllm_backend/cpu_budget.py``) unless
    ``kv_cache_memory_bytes``, ``env.VLLM_CPU_KVCACHE_SPACE`` or ``gpu_memory_utilization``
    size it; a budget that cannot fit is refused when the job is created.
    """

    model_config = ConfigDict(extra="allow", validate_default=True)

    python: str | None = Field(None, min_length=1)
    weight_sync: Literal["auto", "reload", "restart", "ipc", "nccl"] = "auto"
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: PositiveFloat = 600.0

    @model_validator(mode="after")
    def _model_is_the_jobs(self) -> VllmSettings:
        if "model" in self.engine_args:
            raise ValueError("model: the job's model is what vLLM loads; set it there")
        caching = self.engine_args.get("enable_prefix_caching")
        if caching is not None and not isinstance(caching, bool):
            raise ValueError(f"enable_prefix_caching: expected true or false, got {caching!r}")
        kv_bytes = self.engine_args.get("kv_cache_memory_bytes")
        if kv_bytes is not None and (
            isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int) or kv_bytes <= 0
        ):
            raise ValueError(
                f"kv_cache_memory_bytes: expected a positive number of bytes, got {kv_bytes!r}"
            )
        return self

    @property
    def engine_args(self) -> dict[str, Any]:
        """The vLLM engine arguments: every key that is not one of ours."""
        return dict(self.model_extra or {})
