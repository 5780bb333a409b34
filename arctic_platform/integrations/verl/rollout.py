"""The ``arctic`` rollout replica: verl's generation served by the arctic sampling job.

verl's agent loop asks a rollout *server* for token-in, token-out completions
(``server.generate(prompt_ids, sampling_params, request_id)`` returning a ``TokenOutput``) through
its load balancer, and its trainer drives the servers' lifecycle (sleep after generation, wake
with the weight sync, ...). :class:`ArcticTokenServer` is that server: a Ray actor that attaches
to the driver's jobs and forwards every call to ``client.generate`` and friends, so no vLLM runs
in verl's processes. :class:`ArcticRolloutReplica` is the ``RolloutReplica`` that launches it;
verl's replica registry resolves ``actor_rollout_ref.rollout.name=arctic`` to it (see
:mod:`.register`).

Sampling parameters arrive as verl builds them for vLLM: ``temperature``, ``top_p``, ``top_k``,
``repetition_penalty`` (only 1.0, the engines have no penalties), ``logprobs`` (a flag: the
sampled tokens' log-probs), and optionally ``max_tokens``/``max_new_tokens``; without one the
completion may use the rest of ``rollout.response_length``, bounded by the sampling job's
prompt-plus-completion limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from omegaconf import DictConfig
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from arctic_platform.integrations.verl.adapter import ArcticRLClientWrapper
from arctic_platform.integrations.verl.selection import backend_for
from arctic_platform.integrations.verl.verl_config import read_settings, sampling_max_seq_len

FINISHED = {"stop": "completed", "length": "completed", "abort": "aborted"}


def sampling_params_for_engines(
    params: Mapping[str, Any], *, prompt_len: int, response_length: int, max_model_len: int | None
) -> dict[str, Any]:
    """verl's vLLM-style sampling parameters as the engines take them (module doc)."""
    out = dict(params)
    penalty = out.pop("repetition_penalty", None)
    if penalty is not None and float(penalty) != 1.0:
        raise ValueError(
            f"sampling_params.repetition_penalty: {penalty}; the arctic engines have no "
            "repetition penalty (use 1.0)"
        )
    if out.pop("logprobs", None):
        out["logprobs"] = 0
    if out.get("n", 1) != 1:
        raise ValueError(f"sampling_params.n: verl asks for one completion a call, got {out['n']}")
    budget = out.pop("max_tokens", None)
    alias = out.pop("max_new_tokens", None)
    if budget is None:
        budget = alias if alias is not None else response_length
    budget = int(budget)
    if max_model_len is not None:
        room = max_model_len - prompt_len
        if room < 0:
            raise ValueError(
                f"prompt_ids: {prompt_len} tokens exceed max_model_len ({max_model_len})"
            )
        budget = min(budget, room)
    out["max_tokens"] = max(budget, 0)
    return out


class ArcticTokenServer:
    """A verl rollout server backed by the arctic sampling job (see the module doc).

    ``free_cache_engine`` is verl's ``rollout.free_cache_engine``: whether sleeping releases the
    sampler's KV cache between rollouts.
    """

    def __init__(
        self,
        main_config: DictConfig,
        backend_handle: dict[str, Any],
        *,
        response_length: int,
        max_model_len: int | None,
        free_cache_engine: bool,
    ) -> None:
        # This runs in a Ray worker, which only has the plugin registered when
        # VERL_USE_EXTERNAL_MODULES reached it; importing the entry point makes sure (a module
        # registers once, so this is a no-op where verl already imported it).
        import arctic_platform.integrations.verl.register  # noqa: F401

        backend = backend_for(main_config, handle=backend_handle)
        if not isinstance(backend, ArcticRLClientWrapper):
            raise ValueError(
                "main_config: the arctic rollout needs the arctic remote backend chosen "
                "(remote_backend=arctic)"
            )
        self.backend = backend
        self.response_length = response_length
        self.max_model_len = max_model_len
        self.free_cache_engine = free_cache_engine
        self.global_steps: int | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._rejecting = False

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> TokenOutput:
        """One completion of ``prompt_ids`` (``request_id`` is verl's, for its own bookkeeping).

        Takes every keyword verl's server manager passes. Multimodal input (``image_data``,
        ``video_data``, ``audio_data``, ``mm_processor_kwargs``) is refused: the arctic rollout
        serves text models. ``priority`` is a scheduling hint the engines do not have (one queue,
        arrival order); other keywords are refused by name.
        """
        media = {
            "image_data": image_data,
            "video_data": video_data,
            "audio_data": audio_data,
            "mm_processor_kwargs": mm_processor_kwargs or None,
        }
        given = [name for name, value in media.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: the arctic rollout serves text models only (multimodal "
                "input is not supported)"
            )
        if kwargs:
            raise TypeError(f"generate: unexpected keyword arguments {sorted(kwargs)}")
        if self._rejecting:
            raise RuntimeError(f"request {request_id}: generation is paused (abort_all_requests)")
        await self._open.wait()
        ids = [int(t) for t in prompt_ids]
        params = sampling_params_for_engines(
            sampling_params,
            prompt_len=len(ids),
            response_length=self.response_length,
            max_model_len=self.max_model_len,
        )
        result = await self.backend.generate(ids, params)
        log_probs = None
        if "logprobs" in params:
            log_probs = [float(entry["logprob"]) for entry in result.get("logprobs") or []]
        return TokenOutput(
            token_ids=list(result["token_ids"]),
            log_probs=log_probs,
            stop_reason=FINISHED.get(result.get("finish_reason")),
            extra_fields={"global_steps": self.global_steps},
        )

    async def wake_up(self) -> None:
        """Restore the sampler's weights and KV cache (after a sleep)."""
        await self.backend.wake_inference(None)

    async def sleep(self) -> None:
        """Release the sampler's KV cache between rollouts when ``free_cache_engine`` says so."""
        if self.free_cache_engine:
            await self.backend.sleep_inference(1)

    async def clear_kv_cache(self) -> None:
        await self.backend.reset_prefix_cache()

    async def release_kv_cache(self) -> None:
        await self.backend.sleep_inference(1)

    async def resume_kv_cache(self) -> None:
        await self.backend.wake_inference(["kv_cache"])

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Hold new requests until :meth:`resume_generation` (fail them with
        ``reject_request``). Requests already sent to the engines still finish: the sampler has
        no way to recall them."""
        self._open.clear()
        self._rejecting = reject_request

    async def resume_generation(self) -> None:
        self._rejecting = False
        self._open.set()

    async def set_global_steps(self, global_steps: int) -> None:
        """verl's step number, reported with every completion (``extra_fields``)."""
        self.global_steps = int(global_steps)


class ArcticRolloutReplica(RolloutReplica):
    """The ``arctic`` rollout replica: launches one :class:`ArcticTokenServer` (no GPU of its
    own; the sampling job's devices are the backend's).

    ``main_config`` and ``backend_handle`` come from verl's remote-backend trainer
    (``replica_init_kwargs``); a verl that does not pass them cannot run this replica.
    """

    def __init__(
        self,
        replica_rank: int,
        config: DictConfig,
        model_config: DictConfig,
        gpus_per_node: int = 8,
        is_reward_model: bool = False,
        is_teacher_model: bool = False,
        name_suffix: str = "",
        *,
        main_config: DictConfig | None = None,
        backend_handle: dict[str, Any] | None = None,
    ) -> None:
        if main_config is None or backend_handle is None:
            raise ValueError(
                "main_config, backend_handle: the arctic rollout replica needs both; verl's "
                "remote-backend trainer passes them (a verl with verl.remote_backend)"
            )
        if is_reward_model or is_teacher_model:
            raise ValueError(
                "the arctic rollout serves the policy; reward and teacher models need another "
                "rollout (e.g. vllm)"
            )
        super().__init__(replica_rank, config, model_config, gpus_per_node, name_suffix=name_suffix)
        self.main_config = main_config
        self.backend_handle = backend_handle

    def rollout_worker_use_gpu(self) -> bool:
        return False

    def server_kwargs(self) -> dict[str, Any]:
        """The constructor arguments of this replica's :class:`ArcticTokenServer`."""
        settings = read_settings(self.main_config)
        return {
            "main_config": self.main_config,
            "backend_handle": self.backend_handle,
            "response_length": int(self.config.response_length),
            "max_model_len": sampling_max_seq_len(self.main_config, settings),
            "free_cache_engine": bool(self.config.free_cache_engine),
        }

    async def launch_servers(self) -> None:
        """Start the token server as a Ray actor; verl reaches it through ``server_handle``.

        ``server_address`` stays None: the server speaks Ray calls, not HTTP (verl uses the
        address only as the load balancer's key, and there is one replica).
        """
        server = (
            ray.remote(ArcticTokenServer)
            .options(
                name=f"arctic_rollout_server_{self.replica_rank}{self.name_suffix}",
                max_concurrency=self.max_concurrency,
                num_cpus=0,
            )
            .remote(**self.server_kwargs())
        )
        self.servers = [server]
        self._server_handle = server

    async def set_global_steps(self, global_steps: int) -> None:
        """Tell the server verl's step number (verl's remote-backend checkpoint engine calls it)."""
        await asyncio.gather(*[s.set_global_steps.remote(global_steps) for s in self.servers])
