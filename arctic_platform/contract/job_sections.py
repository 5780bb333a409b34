"""The jobs part of a client config: ``model``/``dtype``/``seed`` and the ``training``,
``sampling`` and ``log_prob`` sections, mapped onto the server's ``SubJobConfig`` bodies.

A contract fact shared by the client (``ArcticRLClientConfig`` extends :class:`JobsConfig` with
its backend) and the on-prem server (a reference ``JobConfig`` sent to ``/initialize`` becomes a
:class:`JobsConfig` the same way a flat client config does). Each job inherits ``model``, ``dtype``
and ``seed`` from the top level unless it sets its own. The reference (legacy) flat fields fold
in before validation (:mod:`arctic_platform.contract.legacy_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from arctic_platform.contract.job_config import API_JOB_TYPE, InferenceSettings, TrainingSettings
from arctic_platform.contract.legacy_config import LEGACY_FIELDS, fold_job_fields
from arctic_platform.contract.settings import Seed, Settings, unknown_field_message

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class _Job(Settings):
    """What every job section adds to its sub-job settings: the model, dtype and seed, each
    inherited from the top level unless set here."""

    model: str | None = Field(None, min_length=1)
    dtype: Dtype | None = None
    seed: Seed | None = None

    # The keys that describe the job rather than its engine settings.
    JOB_KEYS: ClassVar[frozenset[str]] = frozenset({"model", "dtype", "seed"})

    def settings(self) -> dict[str, Any]:
        """The sub-job's ``training_config`` / ``inference_config`` as the API writes it."""
        return self.model_dump(mode="json", by_alias=True, exclude=set(self.JOB_KEYS))


class TrainingJob(_Job, TrainingSettings):
    """The trainer: optimizer, schedule, microbatch token budget, LoRA, checkpoint retention (the
    server's ``training_config``, :class:`~arctic_platform.contract.job_config.TrainingSettings`,
    plus the job's model, dtype and seed).

    ``checkpoint_dir`` is the folder (on the machine running the engines) that
    ``save_checkpoint``/``load_checkpoint`` use when called without ``path``: this client passes
    it as the path of each such call, so it is not sent as the server-side root; by default the
    server's own checkpoint folder.
    """

    JOB_KEYS: ClassVar[frozenset[str]] = frozenset({"model", "dtype", "seed", "checkpoint_dir"})


class InferenceJob(_Job, InferenceSettings):
    """A sampler (``sampling``) or a frozen reference scorer (``log_prob``): the server's
    ``inference_config`` (:class:`~arctic_platform.contract.job_config.InferenceSettings`) plus
    the job's model, dtype and seed.

    ``max_seq_len`` bounds prompt plus completion (default: the model's context length).
    ``engine`` picks the sampler: ``torch`` (ours) or ``vllm`` (vLLM in its own process); unset,
    the server's default (ours, unless ``serve --sampling-engine vllm``). ``vllm`` holds the vLLM
    settings (``python``, ``weight_sync``, ``env``, ``startup_timeout_s``) and any vLLM engine
    arguments; our sampler honours ``max_num_seqs`` and ``max_model_len`` from it and the server
    records the rest as ignored. The legacy ``vllm_config`` is folded into ``vllm``.
    """


class JobsConfig(Settings):
    """The jobs a config creates (see module doc); ``ignored_settings`` lists the legacy settings
    accepted without effect on these engines."""

    model: str | None = Field(None, min_length=1)
    dtype: Dtype = "auto"
    seed: Seed | None = None
    training: TrainingJob | None = TrainingJob()
    sampling: InferenceJob | None = None
    log_prob: InferenceJob | None = None
    ignored_settings: dict[str, Any] = Field(default_factory=dict, exclude=True, repr=False)

    # Fields that are bookkeeping, not settings a user writes (left out of unknown-key hints).
    INTERNAL_KEYS: ClassVar[frozenset[str]] = frozenset({"ignored_settings"})

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            cls.refuse_unknown(data)
            data = cls.fold(data)
        return data

    @classmethod
    def fold(cls, data: Mapping) -> dict[str, Any]:
        """``data`` with its legacy fields folded into the nested form, before validation."""
        return fold_job_fields(data)

    @classmethod
    def refuse_unknown(cls, data: Mapping) -> None:
        """Raise naming the keys of ``data`` that are neither fields nor legacy fields."""
        known = cls.known_keys() | LEGACY_FIELDS
        unknown = [k for k in data if k not in known]
        if unknown:
            shown = cls.known_keys() - cls.INTERNAL_KEYS
            raise ValueError(unknown_field_message(unknown, known, cls.__name__, shown))

    @model_validator(mode="after")
    def _check_jobs(self) -> JobsConfig:
        self.check_models()
        return self

    def check_models(self) -> None:
        """Raise unless every configured job has a model (its own or the top level's)."""
        for role, job in self.jobs().items():
            if (job.model or self.model) is None:
                raise ValueError(
                    f"model: required (the model the {role} job loads: a local path, a hub "
                    "name or builtin:tiny); set it at the top level or in the job's section"
                )

    def jobs(self) -> dict[str, TrainingJob | InferenceJob]:
        """The configured jobs by role, in creation order (inference first, training last)."""
        pairs = (
            ("sampling", self.sampling),
            ("log_prob", self.log_prob),
            ("training", self.training),
        )
        return {role: job for role, job in pairs if job is not None}

    def sub_job_configs(self) -> list[dict[str, Any]]:
        """The ``sub_job_configs`` of the Cortex create-job body, one per configured job."""
        return [self._sub_job(role, job) for role, job in self.jobs().items()]

    def _sub_job(self, role: str, job: TrainingJob | InferenceJob) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "job_type": API_JOB_TYPE[role],
            "model_name": job.model or self.model,
            "dtype": job.dtype or self.dtype,
        }
        seed = job.seed if job.seed is not None else self.seed
        if seed is not None:
            spec["seed"] = seed
        key = "training_config" if isinstance(job, TrainingJob) else "inference_config"
        spec[key] = {k: v for k, v in job.settings().items() if v is not None}
        return spec
