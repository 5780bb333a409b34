"""Build the engine of a sub-job from its validated spec (and optionally a saved checkpoint).

Kept apart from the Service so the Service module imports no torch: the server's job bookkeeping
and HTTP layer load fast, and torch is only imported when the first engine is built.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from arctic_platform.contract.engine_protocols import AnyEngine
from arctic_platform.engine.config import SamplingEngineConfig, TrainingEngineConfig
from arctic_platform.server.errors import BadRequest
from arctic_platform.server.job_config import sampling_engine_config, training_engine_config

if TYPE_CHECKING:
    from arctic_platform.server.job_registry import SubJob
    from arctic_platform.server.service import Service

# What builds a sub-job's engine: ``(service, sub_job, source checkpoint record or None)`` to an
# engine of the sub-job's kind. The Service's is :func:`build_engine`; a test hands its Service a
# builder of fakes (``Service(settings, engine_builder=...)``, ``tests/fake_engine.py``).
EngineBuilder: TypeAlias = "Callable[[Service, SubJob, dict | None], AnyEngine]"


def build_engine(service, sub, source: dict | None) -> AnyEngine:
    """A TrainingEngine, SamplingEngine or LogProbEngine for ``sub``, on the server's device (or,
    with ``engine_backend="ray"``, the Ray engine standing in for it)."""
    settings = service.settings
    if settings.engine_backend == "ray":
        from arctic_platform.server.ray_engines import build_ray_engine

        return build_ray_engine(service, sub, source)
    from arctic_platform.engine.models import MODEL_INIT_LOCK

    with MODEL_INIT_LOCK:
        # The first import of an engine module resolves transformers' lazily loaded names, which
        # is not thread-safe: two tenants' first jobs, built at once, failed with ImportError.
        from arctic_platform.engine.logprob_engine import LogProbEngine
        from arctic_platform.engine.sampling_backends import build_sampling_engine
        from arctic_platform.engine.trainer import TrainingEngine
    if sub.kind == "training":
        engine = TrainingEngine(training_config_for(service, sub, source, device=settings.device))
        if source is not None:
            engine.load_checkpoint(source["path"])
        return engine
    config = inference_config_for(service, sub, source, device=settings.device)
    if sub.kind == "sampling":
        return build_sampling_engine(config)
    return LogProbEngine(config)


def training_config_for(service, sub, source: dict | None, *, device: str) -> TrainingEngineConfig:
    """The engine config of training sub-job ``sub`` on ``device`` (local or Ray alike)."""
    if source is not None and not sub.spec.training_config.load_optimizer_states:
        raise BadRequest(
            "training_config.load_optimizer_states: starting from a checkpoint restores its "
            "optimizer state; false is not supported"
        )
    folder = job_checkpoint_folder(service, sub)
    return training_engine_config(
        sub.spec,
        device=device,
        checkpoint_dir=str(folder.parent),
        job_name=folder.name,
        default_seed=service.settings.default_seed,
        model_name=sub.model_path,
    )


def job_checkpoint_folder(service, sub) -> Path:
    """Training sub-job ``sub``'s own checkpoint folder, where its engine saves and loads when no
    path is named: ``<checkpoint root>/<sub-job id>``, the root the job's
    ``training_config.checkpoint_dir`` (checked at creation, ``Service.create_job``) or its
    owner's default."""
    root = sub.spec.training_config.checkpoint_dir
    if root is None:
        root = service.paths.checkpoint_root(service.owner_of(sub.job_id))
    return Path(root) / sub.sub_job_id.replace(":", "-")


def inference_config_for(service, sub, source: dict | None, *, device: str) -> SamplingEngineConfig:
    """The engine config of sampling or log-prob sub-job ``sub`` on ``device``; with ``source``,
    the model is loaded from that checkpoint."""
    return sampling_engine_config(
        sub.spec,
        device=device,
        default_seed=service.settings.default_seed,
        model_name=weights_dir(source) if source is not None else sub.model_path,
        vllm_python=service.settings.vllm_python,
    )


def weights_dir(source: dict, *, field: str = "source_checkpoint_info") -> str:
    """The directory of checkpoint record ``source`` that ``from_pretrained`` loads as a full
    model (for a sub-job started from it, or an OpenAI-compatible ``model``: ``field``)."""
    root = Path(source["path"])
    for candidate in (root, root / "hf"):
        if (candidate / "config.json").is_file():
            return str(candidate)
    raise BadRequest(
        f"{field}: checkpoint {source['checkpoint_id']} holds only a LoRA adapter; "
        "save it with export_hf=true to sample from it"
    )
