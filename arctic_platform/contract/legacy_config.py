"""The reference (legacy) config shapes, folded into the nested job sections: a contract fact.

RL frameworks pass the flat fields of the earlier ``arctic_platform.rl`` client (``model_name``,
``training_gpus``, ``ds_config``, ``vllm_config``, ...) and the reference server's ``JobConfig``
(what the reference client's ``/initialize`` sends) has the same shapes. The client reads them in
its config (:mod:`arctic_platform.client.legacy` adds the backend fields) and the on-prem server
reads a reference ``JobConfig`` body; both fold them here, into the ``training`` / ``sampling`` /
``log_prob`` sections of :class:`~arctic_platform.contract.job_sections.JobsConfig`:

* ``training_gpus`` / ``sampling_gpus`` / ``log_prob_gpus`` decide which jobs exist (0: none);
  the count becomes the job's ``n_gpus``.
* ``vllm_config`` (top level, or in a job's section) becomes that job's ``vllm`` settings.
* DeepSpeed and trainer dicts contribute what our engines have: the optimizer, gradient clipping,
  batch size, LR schedule, gradient checkpointing, attention implementation, the token budget
  (``max_token_len``), the chunked LM head (``logits_optimization`` and its
  ``logits_optimization_peak_mem_size_in_gib``, into ``training.logits``); ``checkpoint_path`` is
  the trainer's ``checkpoint_dir``.
* Settings for GPU stacks we do not run (ZeRO stages, liger, arctic inference, CUDA IPC weight
  sync, ...) are accepted and recorded in ``ignored_settings``, so a user can see what had no
  effect. Nested values given explicitly always win over folded ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROLES = ("training", "sampling", "log_prob")
# Transport settings that older configs keep at the top level.
TRANSPORT_FIELDS = frozenset(
    {
        "comm_protocol",
        "host",
        "port",
        "launch_local_server",
        "startup_timeout",
        "job_ready_timeout",
        "request_timeout",
        "colocate",
        "server_cuda_visible_devices",
        "health_check_interval",
        "server_logs",
        "ray_auto_attach",
    }
)
# Accepted for compatibility, no effect on these engines.
NO_EFFECT_FIELDS = frozenset(
    {
        "log_prob_ds_config",
        "arctic_inference_config",
        "full_determinism",
        "log_prob_engine",
        "cuda_ipc",
        "low_memory",
    }
)
LEGACY_FIELDS = (
    TRANSPORT_FIELDS
    | NO_EFFECT_FIELDS
    | {
        "model_name",
        "training_gpus",
        "sampling_gpus",
        "log_prob_gpus",
        "ds_config",
        "ds_worker_config",
        "training_config",
        "vllm_config",
        "max_seq_len",
        "checkpoint_path",
    }
)
# Keys of the earlier unified client's nested sections.
REFERENCE_TRAINING_KEYS = {
    "full_determinism": "full_determinism",
    "checkpoint_path": "checkpoint_path",
    "ds_config": "ds_config",
    "ds_worker_config": "ds_worker_config",
    "cuda_ipc": "cuda_ipc",
    "low_memory": "low_memory",
}
REFERENCE_SAMPLING_KEYS = {
    "arctic_inference_config": "arctic_inference_config",
    "log_prob_engine": "log_prob_engine",
    "log_prob_ds_config": "log_prob_ds_config",
}
# SkyRL's ds_worker_config names of the logits settings -> training.logits keys.
WORKER_LOGITS_KEYS = {
    "logits_optimization": "optimization",
    "logits_optimization_peak_mem_size_in_gib": "peak_mem_size_in_gib",
}
DS_SCHEDULES = {"WarmupLR": "constant", "WarmupCosineLR": "cosine", "WarmupDecayLR": "linear"}


def split_legacy(data: Mapping) -> tuple[dict, dict]:
    """``(data without its legacy fields, the legacy fields)``, the earlier unified client's keys
    of its ``training``/``sampling`` sections included."""
    out = dict(data)
    flat = {k: out.pop(k) for k in list(out) if k in LEGACY_FIELDS}
    _lift_reference_sections(out, flat)
    return out, flat


def fold_job_fields(data: Mapping) -> dict[str, Any]:
    """``data`` with its legacy job fields folded into the job sections; a legacy field with no
    meaning for jobs (a transport setting) is recorded in ``ignored_settings``."""
    out, flat = split_legacy(data)
    if not flat:
        return out
    folder = JobFolder(out, flat)
    folder.jobs()
    folder.job_settings()
    folder.record_leftovers()
    return folder.out


def _lift_reference_sections(out: dict, flat: dict) -> None:
    """Move the earlier unified client's keys out of ``training``/``sampling`` into ``flat``."""
    for section, keys in (
        ("training", REFERENCE_TRAINING_KEYS),
        ("sampling", REFERENCE_SAMPLING_KEYS),
    ):
        value = out.get(section)
        if not isinstance(value, Mapping) or not set(keys) & set(value):
            continue
        rest = dict(value)
        for key, name in keys.items():
            if key in rest:
                flat.setdefault(name, rest.pop(key))
        if rest:
            out[section] = rest
        else:  # the section only held old keys: job existence is up to the GPU counts
            del out[section]


class JobFolder:
    """Folds the legacy job fields of ``flat`` into ``out``'s job sections (see module doc);
    what it cannot use is recorded in ``ignored``."""

    def __init__(self, out: dict, flat: dict) -> None:
        self.out = out
        self.flat = flat
        self.ignored: dict[str, Any] = dict(out.pop("ignored_settings", None) or {})

    # -- jobs -------------------------------------------------------------------------------

    def jobs(self) -> None:
        """``*_gpus`` decide which jobs exist; the count becomes ``n_gpus``."""
        counts = {r: self.flat.pop(f"{r}_gpus") for r in ROLES if f"{r}_gpus" in self.flat}
        if not counts:
            return
        for role in ROLES:
            n = counts.get(role, 0)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{role}_gpus: expected an integer >= 0, got {n!r}")
            section = self.out.get(role, _ABSENT)
            if n == 0:
                if section not in (_ABSENT, None):
                    raise ValueError(
                        f"{role}_gpus: 0 means no {role} job, but a `{role}` section is configured"
                    )
                self.out[role] = None
            else:
                if section is None:
                    raise ValueError(f"{role}_gpus: {n}, but `{role}` is null (no job)")
                merged = dict(section) if isinstance(section, Mapping) else {}
                merged.setdefault("n_gpus", n)
                self.out[role] = merged

    def job_settings(self) -> None:
        model_name = self.flat.pop("model_name", None)
        if model_name is not None:
            if self.out.get("model") not in (None, model_name):
                raise ValueError(
                    f"model_name: {model_name!r} disagrees with model {self.out['model']!r}"
                )
            self.out["model"] = model_name
        training = self._section("training")
        self._ds_config(training)
        self._worker_config(training)  # before training_config: the worker's settings win
        self._trainer_dict(training)
        if "checkpoint_path" in self.flat:
            self._put(
                training, "checkpoint_dir", self.flat.pop("checkpoint_path"), "checkpoint_path"
            )
        inference = [
            s for s in (self._section("sampling"), self._section("log_prob")) if s is not None
        ]
        if "vllm_config" in self.flat:
            vllm = self.flat.pop("vllm_config")
            if vllm is not None and not isinstance(vllm, Mapping):
                raise ValueError("vllm_config: expected a mapping")
            for section in inference:  # InferenceJob folds it into vllm; vllm's keys win
                section.setdefault("vllm_config", dict(vllm or {}))
            if not inference and vllm:
                self.ignored["vllm_config"] = vllm
        if "max_seq_len" in self.flat:
            length = self.flat.pop("max_seq_len")
            for section in [training, *inference]:
                if section is not None:
                    section.setdefault("max_seq_len", length)

    def _section(self, role: str) -> dict | None:
        """The job's section as a mutable dict; None when the job does not exist."""
        value = self.out.get(role, _ABSENT)
        if value is _ABSENT:
            if role != "training":  # only the training job exists by default
                return None
            value = {}
        if not isinstance(value, Mapping):
            return None  # null (no job), or a wrong type that validation will report
        section = dict(value)
        self.out[role] = section
        return section

    def _put(self, section: dict | None, key: str, value: Any, source: str) -> None:
        if section is None:
            self.ignored[source] = value
        else:
            section.setdefault(key, value)

    def _ds_config(self, training: dict | None) -> None:
        ds = self.flat.pop("ds_config", None)
        if not ds:
            return
        if not isinstance(ds, Mapping):
            raise ValueError("ds_config: expected a mapping (a DeepSpeed config)")
        ds = dict(ds)
        optimizer = ds.pop("optimizer", None)
        if isinstance(optimizer, Mapping):
            params = dict(optimizer.get("params") or {})
            opt = {k: params.pop(k) for k in ("lr", "betas", "eps", "weight_decay") if k in params}
            self._optimizer(training, opt, "ds_config.optimizer")
            if params:
                self.ignored["ds_config.optimizer.params"] = params
        if "gradient_clipping" in ds:
            self._optimizer(training, {"grad_clip": ds.pop("gradient_clipping")}, "ds_config")
        if "train_batch_size" in ds:
            self._put(
                training,
                "train_batch_size",
                ds.pop("train_batch_size"),
                "ds_config.train_batch_size",
            )
        scheduler = ds.pop("scheduler", None)
        if isinstance(scheduler, Mapping):
            self._ds_scheduler(training, scheduler)
        for key, value in ds.items():
            self.ignored[f"ds_config.{key}"] = value

    def _ds_scheduler(self, training: dict | None, scheduler: Mapping) -> None:
        name = DS_SCHEDULES.get(scheduler.get("type", ""))
        if name is None:
            self.ignored["ds_config.scheduler"] = dict(scheduler)
            return
        params = scheduler.get("params") or {}
        schedule = {"name": name, "warmup_steps": int(params.get("warmup_num_steps", 0))}
        if name != "constant":
            schedule["total_steps"] = params.get("total_num_steps")
        if name == "cosine" and "cos_min_ratio" in params:
            schedule["min_lr_ratio"] = params["cos_min_ratio"]
        self._schedule(training, schedule, "ds_config.scheduler")

    def _trainer_dict(self, training: dict | None) -> None:
        config = self.flat.pop("training_config", None)
        if not config:
            return
        if not isinstance(config, Mapping):
            raise ValueError("training_config: expected a mapping")
        config = dict(config)
        optimizer = config.pop("optimizer", None)
        if isinstance(optimizer, Mapping):
            optimizer = dict(optimizer)
            if "gradient_clipping" in optimizer:
                optimizer["grad_clip"] = optimizer.pop("gradient_clipping")
            opt = {
                k: optimizer.pop(k)
                for k in ("lr", "betas", "eps", "weight_decay", "grad_clip")
                if k in optimizer
            }
            self._optimizer(training, opt, "training_config.optimizer")
            for key, value in optimizer.items():
                self.ignored[f"training_config.optimizer.{key}"] = value
        horizon = config.pop("training_horizon", None)
        scheduler = config.pop("lr_scheduler", None)
        if isinstance(scheduler, Mapping):
            name = scheduler.get("type", "constant")
            if name in ("constant", "linear", "cosine"):
                ratio = float(scheduler.get("warmup_ratio", 0.0) or 0.0)
                schedule: dict[str, Any] = {"name": name}
                if horizon:
                    schedule["warmup_steps"] = round(ratio * int(horizon))
                    if name != "constant":
                        schedule["total_steps"] = int(horizon)
                elif ratio:
                    self.ignored["training_config.lr_scheduler.warmup_ratio"] = ratio
                self._schedule(training, schedule, "training_config.lr_scheduler")
            else:
                self.ignored["training_config.lr_scheduler"] = dict(scheduler)
        renames = {
            "max_length": "max_seq_len",
            "dtype": "dtype",
            "gradient_checkpointing": "gradient_checkpointing",
            "attn_implementation": "attn_implementation",
        }
        for old, new in renames.items():
            if old in config:
                self._put(training, new, config.pop(old), f"training_config.{old}")
        for key, value in config.items():
            self.ignored[f"training_config.{key}"] = value

    def _worker_config(self, training: dict | None) -> None:
        worker = self.flat.pop("ds_worker_config", None)
        if not worker:
            return
        if not isinstance(worker, Mapping):
            raise ValueError("ds_worker_config: expected a mapping")
        worker = dict(worker)
        if "enable_gradient_checkpointing" in worker:
            value = worker.pop("enable_gradient_checkpointing")
            self._put(
                training,
                "gradient_checkpointing",
                value,
                "ds_worker_config.enable_gradient_checkpointing",
            )
        if "attn_implementation" in worker:
            value = worker.pop("attn_implementation")
            self._put(
                training, "attn_implementation", value, "ds_worker_config.attn_implementation"
            )
        if "max_token_len" in worker:
            value = worker.pop("max_token_len")
            self._put(
                training, "max_tokens_per_microbatch", value, "ds_worker_config.max_token_len"
            )
        logits = {
            ours: worker.pop(theirs)
            for theirs, ours in WORKER_LOGITS_KEYS.items()
            if theirs in worker
        }
        if logits:
            if training is None:
                self.ignored.update({f"ds_worker_config.{k}": v for k, v in logits.items()})
            else:
                merged = dict(training.get("logits") or {})
                for key, value in logits.items():
                    merged.setdefault(key, value)
                training["logits"] = merged
        for key, value in worker.items():
            self.ignored[f"ds_worker_config.{key}"] = value

    def _optimizer(self, training: dict | None, values: dict, source: str) -> None:
        if not values:
            return
        if training is None:
            self.ignored[source] = values
            return
        optimizer = dict(training.get("optimizer") or {})
        for key, value in values.items():
            optimizer.setdefault(key, list(value) if key == "betas" else value)
        training["optimizer"] = optimizer

    def _schedule(self, training: dict | None, values: dict, source: str) -> None:
        if training is None:
            self.ignored[source] = values
        elif "schedule" not in training:
            training["schedule"] = values

    def record_leftovers(self) -> None:
        for key in sorted(self.flat):
            self.ignored[key] = self.flat[key]
        if self.ignored:
            self.out["ignored_settings"] = self.ignored


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()
