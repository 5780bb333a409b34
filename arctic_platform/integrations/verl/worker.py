"""The forwarder worker: verl's actor/rollout/ref worker, on a CPU, forwarding to the engines.

verl's remote-backend trainer runs this class (one process, no GPU) where it would run its own
FSDP/Megatron workers, and calls it with verl's usual batches. The worker attaches to the driver's
jobs (``backend_handle``, through the registry: :func:`.selection.backend_for`) and answers in
verl's conventions:

* ``compute_log_prob`` / ``compute_ref_log_prob``: log-probs (and entropies) as nested tensors over
  each whole sequence in predict-next order, converted from the engines' position-indexed layout
  (:func:`.batch_convert.predict_next`); ``metrics["mfu"]`` as verl's trainer reads it.
* ``update_actor``: ``ppo_epochs`` passes over the batch in mini-batches (verl's own iterator, so
  the order and the shuffling match verl's), each one ``fwd_bwd`` with the ``verl_grpo`` loss and
  one optimizer ``step``; the metrics come back under verl's names, one value per mini-batch:
  ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``,
  ``loss``, ``grad_norm``, ``lr``, ``mfu`` (and ``actor/entropy_loss``, ``kl_loss``, ``kl_coef``
  when they apply). verl's trainer prefixes them with ``actor/`` and logs ``mfu`` as
  ``perf/mfu/actor``.
* ``update_weights`` syncs the sampler; ``save_checkpoint`` / ``load_checkpoint`` go to the
  training job.

MFU is the model FLOPs verl's ``flops_counter`` estimates for the tokens, per second of the call,
over ``device_peak_tflops`` times the job's devices (a third of that for forward-only calls, as verl
counts them).

The methods are synchronous (verl's profiler wrappers are, and Ray may call them from its own
event loop); the adapter's coroutines run on a private event loop thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from omegaconf import DictConfig
from tensordict import TensorDict
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import (
    Dispatch,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from verl.trainer.distillation import is_distillation_enabled
from verl.utils import tensordict_utils as tu
from verl.utils.flops_counter import ESTIMATE_FUNC
from verl.utils.py_functional import append_to_dict

from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper
from arctic_platform.integrations.verl.batch_convert import predict_next
from arctic_platform.integrations.verl.profiling import ForwarderProfiler
from arctic_platform.integrations.verl.selection import backend_for

ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref")
MESHES = ("actor", "ref", "rollout")
T = TypeVar("T")


class EventLoopThread:
    """An event loop in a daemon thread, to run coroutines from synchronous methods."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()


@dataclass(frozen=True)
class ModelInfo:
    """What the forwarder needs to know about the model: the pad token and its HF config."""

    pad_token_id: int
    hf_config: Any

    def achieved_tflops(self, lengths: list[int], elapsed: float) -> float:
        """Model TFLOP/s of processing sequences of ``lengths`` in ``elapsed`` seconds (verl's
        estimate for the model type; 0 for a type verl has no formula for, as in verl)."""
        estimate = ESTIMATE_FUNC.get(self.hf_config.model_type)
        if estimate is None:
            return 0.0
        return float(estimate(self.hf_config, sum(lengths), lengths, max(elapsed, 1e-9)))


def load_model_info(main_config: DictConfig, pad_token_id: int | None) -> ModelInfo:
    """Tokenizer and HF config of verl's model (built-in names resolve to their local folder)."""
    from transformers import AutoConfig, AutoTokenizer

    from arctic_platform.engine.builtin import resolve_model_path

    model = main_config.actor_rollout_ref.model
    trust = bool(model.get("trust_remote_code", False))
    path = resolve_model_path(str(model.path))
    if pad_token_id is None:
        tokenizer_path = model.get("tokenizer_path")
        tokenizer_path = resolve_model_path(str(tokenizer_path)) if tokenizer_path else path
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust)
        pad_token_id = tokenizer.pad_token_id
        if pad_token_id is None:
            pad_token_id = tokenizer.eos_token_id
        if pad_token_id is None:
            raise ValueError(
                "remote_backend.arctic.pad_token_id: the tokenizer has no pad or eos token; set it"
            )
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    return ModelInfo(int(pad_token_id), hf_config)


class ArcticRLActorRolloutRefWorker(Worker):
    """The ``arctic`` forwarder (see the module doc)."""

    def __init__(
        self,
        config: DictConfig,
        role: str,
        distillation_config: Any = None,
        *,
        main_config: DictConfig | None = None,
        backend_handle: dict[str, Any] | None = None,
    ) -> None:
        Worker.__init__(self)
        if role not in ROLES:
            raise ValueError(f"role: {role!r}; expected one of {', '.join(ROLES)}")
        if main_config is None or backend_handle is None:
            raise ValueError(
                "main_config, backend_handle: the arctic forwarder needs both; verl's "
                "remote-backend trainer passes them (a verl with verl.remote_backend)"
            )
        if is_distillation_enabled(distillation_config):
            raise ValueError("distillation.enabled: not supported by the arctic backend")
        self.config = config
        self.role = role
        self.main_config = main_config
        backend = backend_for(main_config, handle=backend_handle)
        if backend is None:
            raise ValueError(
                "main_config: chooses no remote backend (set remote_backend=arctic, or "
                "trainer.remote_backend)"
            )
        if not isinstance(backend, ArcticRLClientWrapper):
            raise TypeError(
                f"main_config: the chosen remote backend is a {type(backend).__name__}; this "
                "forwarder drives ArcticRLClientWrapper backends"
            )
        self.backend: ArcticRLClientWrapper = backend
        self._loop = EventLoopThread(f"arctic-forwarder-{self.rank}")
        self._model: ModelInfo | None = None
        profiler_config = main_config.get("global_profiler") or {}
        self.profiler = ForwarderProfiler(
            profiler_config.get("save_path") or "outputs/profile", self.rank
        )

    # -- setup ------------------------------------------------------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Register the actor, ref and rollout meshes (one rank) and load the tokenizer info."""
        for mesh in MESHES:
            self._register_dispatch_collect_info(mesh, dp_rank=self.rank, is_collect=True)
        self._model = load_model_info(self.main_config, self.backend.settings.pad_token_id)

    # -- profiling (global_profiler.steps) ------------------------------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, role: str | None = None, profile_step: int | None = None) -> None:
        """Open a profiling window for step ``profile_step`` (:mod:`.profiling`)."""
        self.profiler.start(role=role, step=profile_step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self, run_command: bool = False) -> None:
        """Close the window and write its trace to ``global_profiler.save_path``."""
        self.profiler.stop(run_command=run_command)

    @property
    def model(self) -> ModelInfo:
        if self._model is None:
            raise RuntimeError("init_model() must run before the compute methods")
        return self._model

    # -- log-probs --------------------------------------------------------------------------

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        """Policy log-probs and entropies (``no_lora_adapter``: the reference model's)."""
        reference = bool(tu.get(data, "no_lora_adapter", default=False))
        return self._log_probs(data, reference=reference, entropy_by_default=True)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"))
    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        """Reference-model log-probs."""
        return self._log_probs(data, reference=True, entropy_by_default=False)

    def _log_probs(
        self, data: TensorDict, *, reference: bool, entropy_by_default: bool
    ) -> TensorDict:
        calculate_entropy = bool(tu.get(data, "calculate_entropy", default=entropy_by_default))
        start = time.perf_counter()
        result = self._loop.run(
            self.backend.compute_log_prob(
                data,
                reference=reference,
                calculate_entropy=calculate_entropy,
                temperature=self._temperature(data),
                pad_token_id=self.model.pad_token_id,
            )
        )
        elapsed = time.perf_counter() - start
        outputs = {"log_probs": predict_next(result.log_probs, result.layout)}
        if result.entropy is not None:
            outputs["entropy"] = predict_next(result.entropy, result.layout)
        settings = self.backend.settings
        devices = settings.log_prob.n_gpus if reference else settings.training.n_gpus
        metrics = {
            **result.metrics,
            "mfu": self._mfu(result.layout.seq_lens.tolist(), elapsed, devices) / 3.0,
        }
        return tu.get_tensordict(tensor_dict=outputs, non_tensor_dict={"metrics": metrics})

    # -- training ---------------------------------------------------------------------------

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: TensorDict) -> TensorDict:
        """``ppo_epochs`` passes of ``fwd_bwd`` + ``step`` per mini-batch (see the module doc)."""
        actor = self.config.actor
        mini_batch_size = int(
            tu.get(data, "mini_batch_size", default=None)
            or tu.get(data, "global_batch_size", default=None)
            or int(actor.ppo_mini_batch_size) * int(self.config.rollout.n)
        )
        rows = int(data.batch_size[0])
        if mini_batch_size <= 0 or rows % mini_batch_size:
            raise ValueError(
                f"mini_batch_size: {mini_batch_size} (ppo_mini_batch_size x rollout.n) must "
                f"divide the {rows} rows of the batch"
            )
        epochs = int(tu.get(data, "epochs", default=actor.ppo_epochs))
        seed = int(tu.get(data, "seed", default=actor.data_loader_seed))
        loader_kwargs = tu.get(data, "dataloader_kwargs", default=None)
        loader_kwargs = dict(loader_kwargs) if loader_kwargs else {"shuffle": bool(actor.shuffle)}
        calculate_entropy = bool(
            tu.get(
                data,
                "calculate_entropy",
                default=bool(actor.calculate_entropy) or float(actor.entropy_coeff) != 0.0,
            )
        )
        options = {
            "pad_token_id": self.model.pad_token_id,
            "temperature": self._temperature(data),
            "calculate_entropy": calculate_entropy,
        }
        # Check the whole batch before the first update, so bad input changes no weights.
        self.backend.mini_batch_payload(data, **options)
        metrics: dict[str, list] = {}
        mini_batches = tu.make_iterator(
            data,
            mini_batch_size=mini_batch_size,
            epochs=epochs,
            seed=seed,
            dataloader_kwargs=loader_kwargs,
        )
        for mini_batch in mini_batches:
            payload, layout = self.backend.mini_batch_payload(mini_batch, **options)
            start = time.perf_counter()
            step_metrics = self._loop.run(self.backend.train_mini_batch(payload))
            elapsed = time.perf_counter() - start
            step_metrics["mfu"] = self._mfu(
                layout.seq_lens.tolist(), elapsed, self.backend.settings.training.n_gpus
            )
            append_to_dict(metrics, step_metrics)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})

    # -- weights and checkpoints -------------------------------------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict:
        """Sync the trainer's weights into the sampler (``global_steps`` is verl's step, kept
        by the rollout replica through ``set_global_steps``)."""
        return self._loop.run(self.backend.update_weights(mode=mode))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
    ) -> dict:
        """Save the training job's state under ``local_path`` (verl's ``global_step_N/actor``
        folder, which already names ``global_step``)."""
        self._refuse_hdfs(hdfs_path)
        return self._loop.run(
            self.backend.save_checkpoint(local_path, max_ckpt_to_keep=max_ckpt_to_keep)
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False
    ) -> dict:
        """Restore the training job from the newest checkpoint under ``local_path``."""
        self._refuse_hdfs(hdfs_path)
        if del_local_after_load:
            raise ValueError(
                "trainer.del_local_ckpt_after_load: not supported by the arctic backend (the "
                "checkpoint folder is the engines' own)"
            )
        return self._loop.run(self.backend.load_checkpoint(local_path))

    # -- helpers ----------------------------------------------------------------------------

    def _temperature(self, data: TensorDict) -> float:
        return float(tu.get(data, "temperature", default=self.config.rollout.temperature))

    def _mfu(self, lengths: list[int], elapsed: float, devices: int) -> float:
        achieved = self.model.achieved_tflops(lengths, elapsed)
        return achieved / (self.backend.settings.device_peak_tflops * devices)

    @staticmethod
    def _refuse_hdfs(hdfs_path: str | None) -> None:
        if hdfs_path:
            raise ValueError(
                "trainer.default_hdfs_dir: HDFS checkpoints are not supported by the arctic "
                "backend; leave it null"
            )
