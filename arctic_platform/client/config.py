"""``ArcticRLClientConfig``: which backend runs the compute and which jobs it creates.

One typed object, loadable from YAML, serves ``arctic_platform.client`` and ``arctic_platform.rl``::

    model: Qwen/Qwen3-0.6B
    seed: 1
    backend: {type: http, url: "http://trainer-box:7000", token_env: ARCTIC_TOKEN}
    training: {optimizer: {lr: 1.0e-6}, max_tokens_per_microbatch: 8192}
    sampling: {max_batch_size: 64}
    log_prob: {}

* ``backend`` is a discriminated union on ``type``: ``inprocess`` (the default), ``http``,
  ``cortex`` or ``ray``. Secrets never appear in it: it names the environment variable that holds
  a token (``token_env``, ``pat_env_var``).
* ``training``, ``sampling`` and ``log_prob`` describe the jobs. A training job exists unless
  ``training: null``; a sampling or log-prob job exists only when its section is present. Each job
  inherits ``model``, ``dtype`` and ``seed`` from the top level unless it sets its own.
  :meth:`ArcticRLClientConfig.to_create_job_request` maps them onto the server's ``SubJobConfig``.
* ``training_job_id`` / ``sampling_job_id`` / ``log_prob_job_id`` attach to running jobs instead
  of creating new ones (what ``client.reconnect_config()`` fills in).

Every section forbids unknown keys; the error names the key and suggests the closest known one.
The flat field names RL frameworks already pass (``model_name``, ``comm_protocol``,
``training_gpus``, ``backend="local"``, ``ds_config``, ...) are accepted and folded into this form
(:mod:`arctic_platform.client.legacy`); what has no meaning here is kept in ``ignored_settings``.
Importing this module needs only pydantic and PyYAML (no torch).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlparse

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from arctic_platform.contract.job_config import CreateJobRequest

# The job sections are the contract's; they stay importable from here, as before.
from arctic_platform.contract.job_sections import InferenceJob as InferenceJob
from arctic_platform.contract.job_sections import JobsConfig
from arctic_platform.contract.job_sections import TrainingJob as TrainingJob
from arctic_platform.contract.legacy_config import LEGACY_FIELDS
from arctic_platform.contract.settings import (
    LoraConfig,
    OptimizerConfig,
    SchedulerConfig,
    Settings,
    did_you_mean,
)

DEFAULT_MAX_REQUEST_BYTES = 60 * 1024 * 1024
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


_Section = Settings


# -- backends ---------------------------------------------------------------------------------


class InProcessBackend(_Section):
    """Engines in this process (needs the ``engine`` extra). Checkpoints and job records go to
    ``data_dir``."""

    type: Literal["inprocess"] = "inprocess"
    data_dir: Path = Path("arctic-data")
    device: str = "auto"
    max_concurrent_ops: PositiveInt = 2
    job_ready_timeout: PositiveFloat = 1800.0


class _WatchesLiveness(_Section):
    """A server reached over the network, whose silence during a long op is noticed."""

    # While an op is in flight the server must answer a probe (the on-prem API's /health, the
    # Cortex API's capacity) within this many seconds, else the op fails naming a hung or stopped
    # server (None: wait up to request_timeout, or poll_timeout).
    liveness_timeout: PositiveFloat | None = 30.0


class HttpBackend(_WatchesLiveness):
    """An ``arctic-platform serve`` process (the on-prem API).

    Give ``url``, or ``host`` and ``port``. ``token_env`` names the environment variable holding
    the bearer token. With ``launch_local_server`` the client starts ``arctic-platform serve`` on
    ``host:port`` (``port: 0`` picks a free one) with ``data_dir`` and ``device``, and stops it at
    shutdown. A failure to connect is retried ``connect_retries`` times; a 429 (one of the
    server's per-tenant limits is full, and the server did nothing with the request)
    ``busy_retries`` times, waiting from 0.5 s doubling up to 10 s.
    """

    type: Literal["http"] = "http"
    url: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(7000, ge=0, le=65535)
    token_env: str | None = None
    launch_local_server: bool = False
    data_dir: Path = Path("arctic-data")
    device: str = "auto"
    startup_timeout: PositiveFloat = 600.0
    job_ready_timeout: PositiveFloat = 1800.0
    request_timeout: PositiveFloat = 1800.0
    connect_retries: NonNegativeInt = 3
    busy_retries: NonNegativeInt = 8

    @model_validator(mode="after")
    def _check(self) -> HttpBackend:
        if self.url is not None:
            check_url("url", self.url)
            if self.launch_local_server:
                raise ValueError("launch_local_server: give host and port, not url, to launch")
        elif self.port == 0 and not self.launch_local_server:
            raise ValueError("port: 0 (a free port) only makes sense with launch_local_server")
        return self

    @property
    def base_url(self) -> str:
        if self.url is not None:
            return self.url.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


class CortexBackend(_WatchesLiveness):
    """A server speaking the Cortex/SnowAPI job API (``arctic-platform serve`` included).

    ``base_url`` (e.g. ``http://127.0.0.1:7000``) or ``host`` (an account host; the URL is then
    ``https://{host}``), plus ``database``, ``schema`` and ``endpoint``. Authentication
    (``auth: auto``): the PAT headers are sent whenever ``pat_env_var`` is set in the environment,
    and required unless ``base_url`` is a plain-HTTP loopback URL (a local server without tokens).
    ``auth: pat`` always requires the token; ``auth: none`` never sends it.

    Data-plane requests are polled every ``poll_interval`` s, growing by ``poll_backoff`` up to
    ``poll_max_interval``, for at most ``poll_timeout`` s. Request bodies above
    ``max_request_bytes`` travel as chunk groups. Transient failures are retried ``max_retries``
    times, waiting from ``retry_initial_wait`` up to ``retry_max_wait`` seconds (exponential, with
    jitter). While an op is in flight, a server that leaves ``GET {prefix}/capacity`` unanswered
    for ``liveness_timeout`` seconds fails the op naming a hung or stopped server.
    """

    type: Literal["cortex"] = "cortex"
    base_url: str | None = None
    host: str | None = None
    database: str = ""
    schema_: str = Field("", alias="schema")
    endpoint: str = Field("cortex-training", min_length=1)
    pat_env_var: str = Field("CORTEX_PAT", min_length=1)
    auth: Literal["auto", "pat", "none"] = "auto"
    verify_tls: bool = True
    request_timeout: PositiveFloat = 300.0
    poll_timeout: PositiveFloat = 1800.0
    job_ready_timeout: PositiveFloat = 1800.0
    poll_interval: PositiveFloat = 0.5
    poll_backoff: float = Field(1.25, ge=1.0)
    poll_max_interval: PositiveFloat = 6.0
    max_retries: NonNegativeInt = 10
    retry_initial_wait: PositiveFloat = 0.5
    retry_max_wait: PositiveFloat = 10.0
    max_request_bytes: int = Field(DEFAULT_MAX_REQUEST_BYTES, ge=64 * 1024)

    @model_validator(mode="after")
    def _check(self) -> CortexBackend:
        if self.base_url is None and self.host is None:
            raise ValueError("base_url or host: give one (where the Cortex API is served)")
        if self.base_url is not None:
            check_url("base_url", self.base_url)
        if not self.database or not self.schema_:
            raise ValueError("database and schema: both are required (they are part of the URL)")
        return self

    @property
    def root_url(self) -> str:
        return (self.base_url or f"https://{self.host}").rstrip("/")

    @property
    def prefix(self) -> str:
        return (
            f"{self.root_url}/api/v2/databases/{self.database}/schemas/{self.schema_}/"
            f"{self.endpoint}"
        )

    @property
    def is_local_plain_http(self) -> bool:
        """A ``http://`` URL on loopback: a local server, which may run without tokens."""
        if self.base_url is None:
            return False
        parsed = urlparse(self.base_url)
        return parsed.scheme == "http" and (parsed.hostname or "") in LOOPBACK_HOSTS

    def resolve_pat(self) -> str | None:
        """The PAT to send, or None; raises when one is required but the variable is unset."""
        if self.auth == "none":
            return None
        token = os.environ.get(self.pat_env_var) or None
        if token is None and (self.auth == "pat" or not self.is_local_plain_http):
            raise ValueError(
                f"pat_env_var: the environment variable {self.pat_env_var} holding the Cortex "
                "programmatic access token is unset or empty"
            )
        return token


class RayBackend(_Section):
    """Ray actors, one per device; the training job runs data-parallel over its workers.

    ``address``: ``auto`` (the cluster ``RAY_ADDRESS`` names, or the one this process already
    belongs to, else a new private one; a cluster that merely runs on the same machine is not
    joined), ``local`` (a new private one) or a cluster address (``host:port`` or
    ``ray://host:port``). Which cluster was joined is logged.
    ``num_training_workers`` (the training job's ``n_gpus``) ranks train with ``data_parallel``
    ``ddp`` (replicated) or ``fsdp`` (sharded); ``colocate`` puts trainer and inference replicas
    on the same devices. ``data_dir`` (job records, default checkpoints) is a path on this
    machine; with workers on several nodes it must be storage every node sees. Reconnecting from
    another process needs the job ids from ``reconnect_config()`` and the actor handle
    ``get_server_state()`` returns.
    """

    type: Literal["ray"] = "ray"
    address: str = Field("auto", min_length=1)
    namespace: str | None = None
    num_training_workers: PositiveInt = 1
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    colocate: bool = False
    data_dir: Path = Path("arctic-data")
    device: str = "auto"
    max_concurrent_ops: PositiveInt = 2
    job_ready_timeout: PositiveFloat = 1800.0

    def training_placement(self, training: TrainingJob | None) -> dict[str, Any]:
        """The training job's ``n_gpus`` (its worker count) and ``data_parallel`` on Ray: the
        job's own values, else this backend's; both given and different is an error naming
        the two fields."""
        from_job = training is not None and "n_gpus" in training.model_fields_set
        both = from_job and "num_training_workers" in self.model_fields_set
        if both and training.n_gpus != self.num_training_workers:
            raise ValueError(
                f"backend.num_training_workers: {self.num_training_workers} disagrees with "
                f"training.n_gpus: {training.n_gpus}; set one of them"
            )
        chosen = training.data_parallel if training is not None else None
        explicit = "data_parallel" in self.model_fields_set
        if chosen is not None and explicit and chosen != self.data_parallel:
            raise ValueError(
                f"backend.data_parallel: {self.data_parallel} disagrees with "
                f"training.data_parallel: {chosen}; set one of them"
            )
        return {
            "n_gpus": training.n_gpus if from_job else self.num_training_workers,
            "data_parallel": chosen or self.data_parallel,
        }


Backend = Annotated[
    InProcessBackend | HttpBackend | CortexBackend | RayBackend, Field(discriminator="type")
]
BACKEND_TYPES = ("inprocess", "http", "cortex", "ray")


def _check_backend_type(backend: Any) -> None:
    """A clear error for a missing or misspelt ``backend.type`` (before the union reports it)."""
    if not isinstance(backend, Mapping):
        return
    kind = backend.get("type")
    if kind is None:
        raise ValueError(f"backend.type: required; one of {', '.join(BACKEND_TYPES)}")
    if kind not in BACKEND_TYPES:
        raise ValueError(
            f"backend.type: unknown backend {kind!r}{did_you_mean(kind, set(BACKEND_TYPES))}; "
            f"choose one of {', '.join(BACKEND_TYPES)}"
        )


def check_url(name: str, url: str) -> None:
    """A ``ValueError`` naming ``name`` unless ``url`` is an http(s) URL with a usable port."""
    try:
        parsed = urlparse(url)
        port = parsed.port  # a port that is no number, or out of range, raises here
    except ValueError as exc:
        raise ValueError(f"{name}: {url!r} is not a valid URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"{name}: expected an http:// or https:// URL, got {url!r}")
    if port == 0:
        raise ValueError(f"{name}: {url!r} names port 0")


# -- jobs -------------------------------------------------------------------------------------


# The engine settings, under the names this config has always exported.
OptimizerSettings = OptimizerConfig
ScheduleSettings = SchedulerConfig
LoraSettings = LoraConfig


# -- the config -------------------------------------------------------------------------------


class ArcticRLClientConfig(JobsConfig):
    """Backend, jobs and reconnect ids of a client (see the module docstring)."""

    backend: Backend = InProcessBackend()
    training_job_id: str | None = None
    sampling_job_id: str | None = None
    log_prob_job_id: str | None = None
    tensor_type: Literal["auto", "numpy", "torch"] = "auto"
    experiment_name: str | None = None
    # Provenance of a folded legacy config: "local" lets the environment override apply.
    legacy_backend: Literal["local", "dss-platform"] | None = Field(None, exclude=True)
    # The flat legacy fields as the caller set them; they read back as attributes.
    legacy_fields: dict[str, Any] = Field(default_factory=dict, exclude=True, repr=False)

    INTERNAL_KEYS: ClassVar[frozenset[str]] = frozenset(
        {"legacy_backend", "ignored_settings", "legacy_fields"}
    )

    @classmethod
    def fold(cls, data: Mapping) -> dict[str, Any]:
        """The contract's job folding plus the legacy backend fields (client/legacy.py)."""
        from arctic_platform.client.legacy import fold_legacy

        data = fold_legacy(data)
        _check_backend_type(data.get("backend"))
        return data

    @field_validator("training_job_id", "sampling_job_id", "log_prob_job_id", mode="before")
    @classmethod
    def _id_as_str(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _check_jobs(self) -> ArcticRLClientConfig:
        if isinstance(self.backend, RayBackend):
            self.backend.training_placement(self.training)
        if self.reconnecting:
            return self
        if not self.jobs():
            raise ValueError(
                "training, sampling, log_prob: no job configured; configure at least one "
                "(or give *_job_id to attach to running jobs)"
            )
        self.check_models()
        return self

    def __getattr__(self, name: str) -> Any:
        """A flat legacy field (``comm_protocol``, ``training_gpus``, ...) reads back as set.

        Frameworks read their own fields after building the client (SkyRL:
        ``rl_config.comm_protocol``). A field the caller did not set reads as the nested
        config's equivalent (:meth:`legacy_value`).
        """
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in LEGACY_FIELDS:
                return self.legacy_value(name)
            raise

    def legacy_value(self, name: str) -> Any:
        """The flat legacy field ``name``: as the caller set it, else derived from this config
        (``model_name``, ``comm_protocol``, ``*_gpus``, ``checkpoint_path``, ``host``/``port``),
        else None."""
        given = self.__dict__.get("legacy_fields") or {}
        if name in given:
            return given[name]
        backend = self.backend
        jobs = self.jobs()
        derived: dict[str, Any] = {
            "model_name": self.model,
            "comm_protocol": {"ray": "ray", "http": "http", "cortex": "cortex"}.get(backend.type),
            "checkpoint_path": self.training.checkpoint_dir if self.training else None,
            **{f"{role}_gpus": job.n_gpus for role, job in jobs.items()},
        }
        if isinstance(backend, HttpBackend) and backend.url is None:
            derived.update(host=backend.host, port=backend.port)
        if name.endswith("_gpus"):
            return derived.get(name, 0)
        return derived.get(name)

    # -- views ------------------------------------------------------------------------------

    @property
    def reconnecting(self) -> bool:
        """True when the config names running jobs to attach to."""
        return bool(self.attach_ids())

    def attach_ids(self) -> dict[str, str]:
        """The running jobs this config attaches to: ``{role: sub-job id}`` of the ids it sets."""
        ids = {
            "training": self.training_job_id,
            "sampling": self.sampling_job_id,
            "log_prob": self.log_prob_job_id,
        }
        return {role: job_id for role, job_id in ids.items() if job_id is not None}

    def to_create_job_request(self) -> CreateJobRequest:
        """The job spec every backend creates jobs from (validated by the server's model)."""
        return CreateJobRequest.model_validate(
            {"sub_job_configs": self.sub_job_configs(), "experiment_name": self.experiment_name}
        )

    def create_job_body(self) -> dict[str, Any]:
        """:meth:`to_create_job_request` as the JSON body of the server's create-job call (on
        Ray, with the training job's worker count and data-parallel strategy)."""
        body = self.to_create_job_request().model_dump(
            mode="json", by_alias=True, exclude_none=True
        )
        if isinstance(self.backend, RayBackend):
            placement = self.backend.training_placement(self.training)
            for spec in body["sub_job_configs"]:
                if spec["job_type"] == "training":
                    spec["training_config"].update(placement)
        return body

    # -- YAML -------------------------------------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> ArcticRLClientConfig:
        """Load a YAML file (a mapping at the top level); errors name the file and the field."""
        from arctic_platform.client.yaml_files import load_mapping

        return cls.model_validate(load_mapping(path, what="config"))

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """The config as YAML (written to ``path`` when given); ``from_yaml`` reads it back."""
        import yaml

        data = self.model_dump(mode="json", by_alias=True)
        # The backend right after model, dtype and seed, where users write it (the job sections
        # come from JobsConfig, so pydantic lists them before it).
        data = {**{k: data[k] for k in ("model", "dtype", "seed", "backend")}, **data}
        text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
        if path is not None:
            Path(path).write_text(text)
        return text


def load_config(config: ArcticRLClientConfig | Mapping | str | os.PathLike) -> ArcticRLClientConfig:
    """A config object from an object, a dict, or the path of a YAML file."""
    if isinstance(config, ArcticRLClientConfig):
        return config
    if isinstance(config, Mapping):
        return ArcticRLClientConfig.model_validate(config)
    if isinstance(config, (str, os.PathLike)):
        return ArcticRLClientConfig.from_yaml(config)
    raise TypeError(
        "config: expected an ArcticRLClientConfig, a dict or the path of a YAML file, got "
        f"{type(config).__name__}"
    )
