"""``VllmSamplingEngine``: the sampling job's engine when ``sampling.engine`` is ``vllm``.

It has the ops and result shapes of our :class:`~arctic_platform.engine.sampler.SamplingEngine`,
and does in this process everything that does not need vLLM: requests are validated and tokenized
by the shared :class:`~arctic_platform.engine.sampling_requests.RequestShaper` (same errors naming
the same fields, same seed stream for requests without a seed), and synced weights are validated
and staged by :class:`~.staging.WeightStaging`. The vLLM process (:mod:`.worker`) only generates
from token ids and loads staged weights.

Weight sync is correct before it is fast. The path is ``sampling.vllm.weight_sync``, chosen by
device when ``auto`` (:func:`~.transfer.resolve_weight_sync`): on CPU ``reload``, which writes
the full weights as a model directory and loads it into the running engine (vLLM's
``reload_weights``, which re-processes each layer it loads into vLLM's CPU kernel layout, then a
re-pack of the kernels reload leaves stale: the LM head tied to the embedding); ``restart``
builds a new vLLM engine on that directory instead (seconds per sync). Both are tested on CPU
against a vLLM engine started fresh on the same weights. On CPU the engine also sizes vLLM's
memory from the job (:mod:`.cpu_budget`), refusing before the process starts when it cannot
fit. On CUDA
``auto`` is ``ipc``: vLLM's weight-transfer engine loads CUDA IPC handles of the weights in place
(``nccl`` broadcasts them instead); see :mod:`.transfer`. The CUDA paths are untested: no GPU was
available where they were written (README, 'vLLM sampling engine'). So ``auto`` does not stake a
run on them: when its transfer path fails, at engine start (a vLLM without the transfer's engine
argument included: the worker drops the argument only under ``auto`` and says so), at the copy of
a sync's weights onto vLLM's GPU or part-way through a sync, the engine
logs a warning with the reason, drops the transfer path for good and completes that sync (and
every later one) with ``reload`` (:data:`~.transfer.FALLBACK_WEIGHT_SYNC`), whose complete weights
make the served state defined again; ``weight_sync_fallback`` and ``info`` keep the reason. An
explicit ``ipc`` or ``nccl`` stays strict: a failure there is the user's to see.

Sleep and wake map to vLLM's sleep mode where vLLM supports it (CUDA, with ``enable_sleep_mode``,
which this engine turns on by default on GPU); on CPU vLLM has none, and the result says that
nothing was released.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from arctic_platform.contract.sampling_params import SamplingParams
from arctic_platform.engine.builtin import resolve_model_path
from arctic_platform.engine.config import SamplingEngineConfig
from arctic_platform.engine.errors import EngineInputError, SamplerStateError
from arctic_platform.engine.models import (
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from arctic_platform.engine.sampling_requests import (
    RequestShaper,
    SampleRequest,
    checked_max_model_len,
    model_context,
)
from arctic_platform.engine.vllm_backend.cpu_budget import plan_cpu_memory
from arctic_platform.engine.vllm_backend.environment import resolve_python, worker_env
from arctic_platform.engine.vllm_backend.process import (
    VllmWorkerDied,
    VllmWorkerError,
    WorkerProcess,
)
from arctic_platform.engine.vllm_backend.staging import WeightStaging
from arctic_platform.engine.vllm_backend.transfer import (
    FALLBACK_WEIGHT_SYNC,
    TRANSFER_ENGINE_ARG,
    TRANSFER_PATHS,
    WEIGHT_SYNC_FIELD,
    IpcTransfer,
    NcclTransfer,
    optional_engine_args,
    resolve_weight_sync,
    transfer_engine_args,
)
from arctic_platform.engine.wake_tags import SLEEP_TAGS, checked_wake_tags
from arctic_platform.engine.weights import WeightLoadError, Weights

log = logging.getLogger(__name__)

_SEED_MODULUS = 1 << 63  # vLLM seeds a torch.Generator: a non-negative 63-bit seed


class VllmSamplingEngine:
    """A sampling engine whose generation runs in a vLLM process (see the module docstring)."""

    # Generate calls run side by side: the vLLM process decodes them together (its running batch,
    # ``worker.py``), so a call that arrives while another decodes joins it.
    concurrent_generate = True

    def __init__(self, config: SamplingEngineConfig) -> None:
        from transformers import AutoConfig

        self.config = config
        model = config.model
        self.device = resolve_device(model.device)
        source = Path(resolve_model_path(model.name))
        if not source.is_dir():
            raise FileNotFoundError(
                f"model {model.name!r}: the vLLM engine loads a local model directory "
                f"({source} is not one)"
            )
        hf_config = AutoConfig.from_pretrained(source, trust_remote_code=model.trust_remote_code)
        self.tokenizer = load_tokenizer(model)
        self.vocab_size = hf_config.get_text_config().vocab_size
        self.max_model_len = checked_max_model_len(config.max_model_len, model_context(hf_config))
        self._shaper = RequestShaper(
            self.tokenizer, config, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        dtype = resolve_dtype(model.dtype, self.device)
        settings = config.vllm
        self.weight_sync_requested = settings.weight_sync
        self.weight_sync = resolve_weight_sync(settings.weight_sync, self.device)
        self.weight_sync_fallback: str | None = None  # why ``auto`` left its transfer path
        self.sleep_supported = self.device.type == "cuda"
        env = worker_env(settings.env, self.device)
        self.memory = None  # on CPU: what the vLLM process may hold, refused before it starts
        if self.device.type == "cpu":
            self.memory = plan_cpu_memory(config, hf_config, dtype, self.max_model_len, env)
        self._dir = Path(tempfile.mkdtemp(prefix="arctic-vllm-"))
        self._process: WorkerProcess | None = None
        self._transfer: IpcTransfer | NcclTransfer | None = None
        self._weights_complete = True
        try:
            self._staging = WeightStaging(source, self._dir / "weights", hf_config, dtype)
            self.python = resolve_python(settings.python)
            self._process = WorkerProcess(self.python, env=env, log_path=self._dir / "worker.log")
            args = self._engine_args(str(dtype).removeprefix("torch."))
            self.info = self._process.call(
                "start",
                timeout=settings.startup_timeout_s,
                model=str(source),
                engine_args=args,
                optional=optional_engine_args(
                    settings.weight_sync, self.weight_sync, settings.engine_args
                ),
            )
            dropped = self.info.pop("dropped_engine_args")
            self.info["weight_sync"] = self.weight_sync
            if self.memory is not None:
                self.info.update(self.memory.describe())
            if self.weight_sync in TRANSFER_PATHS:
                self._start_transfer(dropped)
        except BaseException:
            self.close()
            raise
        self._asleep: set[str] = set()
        # The tokenizer, the seed stream and waking: one generate call at a time.
        self._validating = threading.Lock()
        log.info("vLLM engine ready: %s (pid %d)", self.info, self._process.pid)

    def _start_transfer(self, dropped: Sequence[str] = ()) -> None:
        """Open the weight-transfer path; under ``auto`` any failure but the worker's death
        (a vLLM without the transfer's engine argument, which the worker then ``dropped``, no
        CUDA, a vLLM refusing ``init_weight_transfer_engine``, ...) falls back to the files."""
        if TRANSFER_ENGINE_ARG in dropped:  # only ever optional under ``auto``
            self._fall_back(
                f"this vLLM ({self.info.get('vllm_version')}) has no engine argument "
                f"{TRANSFER_ENGINE_ARG!r} (vLLM >= 0.32 has it)"
            )
            return
        try:
            if self.weight_sync == "ipc":
                self._transfer = IpcTransfer(self._process, self.device)
            else:
                self._transfer = NcclTransfer(self._process, self.device, self.info["workers"])
        except VllmWorkerDied:
            raise
        except Exception as exc:
            if self.weight_sync_requested != "auto":
                raise
            self._fall_back(f"starting the {self.weight_sync} weight transfer failed ({exc})")

    def _fall_back(self, reason: str) -> None:
        """Drop the transfer path for good: ``auto`` syncs through the staged files from now on."""
        log.warning(
            "%s is 'auto' and %s: weight syncs use %r (staged files) from now on",
            WEIGHT_SYNC_FIELD,
            reason,
            FALLBACK_WEIGHT_SYNC,
        )
        transfer, self._transfer = self._transfer, None
        if transfer is not None:
            transfer.close()
        self.weight_sync = FALLBACK_WEIGHT_SYNC
        self.weight_sync_fallback = reason
        self.info = {**self.info, "weight_sync": self.weight_sync, "weight_sync_fallback": reason}

    def _engine_args(self, dtype: str) -> dict:
        """vLLM engine arguments: what our config fixes, then the user's (which win)."""
        config = self.config
        args = {
            "dtype": dtype,
            "seed": config.seed,
            "max_num_seqs": config.max_batch_size,
            "max_model_len": self.max_model_len,
            "max_logprobs": config.max_logprobs,
            # Ours are the log-probs of the temperature-scaled distribution (sampling_ops).
            "logprobs_mode": "processed_logprobs",
            **transfer_engine_args(self.weight_sync),
        }
        if self.memory is not None:
            args["enforce_eager"] = True  # compiling triples startup for little gain on CPU
            args.update(self.memory.engine_args)  # the KV cache this job needs, not the node's
        else:
            args["enable_sleep_mode"] = True
        return {**args, **config.vllm.engine_args}

    @property
    def pid(self) -> int | None:
        """The vLLM process id (for supervision and tests)."""
        return None if self._process is None else self._process.pid

    # ------------------------------------------------------------------------------------------
    # generate

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: Mapping | SamplingParams | Sequence[Mapping | None] | None = None,
    ) -> list[dict]:
        """Complete every prompt ``n`` times; one output dict per prompt and sample, in order."""
        with self._validating:
            requests = self._shaper.validate(prompts, sampling_params)
            self._check_weights()
            self._shaper.assign_seeds(requests)
            if self._asleep:
                asleep = sorted(self._asleep)
                log.warning("generate() on a sleeping sampler: waking it (%s)", asleep)
                self.wake()
        results = self._process.call(
            "generate",
            requests=[
                {"prompt_token_ids": r.token_ids, "params": _vllm_params(r)} for r in requests
            ],
        )
        outputs = []
        for request, samples in zip(requests, results, strict=True):
            if request.params.greedy and request.params.n > 1:  # vLLM decodes one, as we said
                samples = [{**samples[0], "sample_index": i} for i in range(request.params.n)]
            for sample in samples:
                output = {
                    "text": sample["text"],
                    "token_ids": sample["token_ids"],
                    "finish_reason": sample["finish_reason"],
                    "stop_reason": sample["stop_reason"],
                    "prompt_len": len(request.token_ids),
                    "prompt_index": request.index,
                    "sample_index": sample["sample_index"],
                    "cached_prompt_tokens": sample["cached_prompt_tokens"],
                }
                if "logprobs" in sample:
                    output["logprobs"] = sample["logprobs"]
                outputs.append(output)
        return outputs

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float | None]:
        """Each prompt token's log-prob given the tokens before it (None for the first), as
        :meth:`SamplingEngine.prompt_logprobs <arctic_platform.engine.sampler.SamplingEngine.
        prompt_logprobs>` returns them: vLLM's ``prompt_logprobs``, refused like a ``generate``
        prompt (``prompts[0]``) when a token id or the length is out of range."""
        (request,) = self._shaper.validate([list(token_ids)], {"max_tokens": 1})
        self._check_weights()
        if self._asleep:
            self.wake()
        return self._process.call("prompt_logprobs", prompt_token_ids=request.token_ids)

    # ------------------------------------------------------------------------------------------
    # weights, sleep and wake

    def load_weights(self, named_tensors: Weights) -> dict:
        """Validate and stage the weights, then have the vLLM process serve them.

        Names, shapes and dtypes follow :func:`~arctic_platform.engine.weights.load_into_model`;
        a partial sync keeps the other weights (on the file paths; the CUDA transfer paths
        refuse one, see :mod:`.transfer`). Nothing changes on a refusal or a failed file load: the
        previous weights stay served. Returns ``{"tensors", "bytes", "complete", "method"}``;
        ``method`` is the path that loaded them (``reload`` when ``auto`` fell back).
        """
        if self._transfer is not None:
            return self._send(named_tensors)
        return self._load_files(named_tensors)

    def _load_files(self, named_tensors: Weights) -> dict:
        """Stage the weights and have the worker ``restart`` or ``reload`` on them."""
        version, report = self._staging.stage(named_tensors)
        try:
            self._process.call(self.weight_sync, model=str(version))
        except VllmWorkerError:
            self._staging.discard(version)
            raise
        self._staging.commit(version)
        self._asleep.clear()  # a restarted engine is awake; a reloaded one was woken to load
        self._weights_complete = True
        return {**report, "method": self.weight_sync}

    def _send(self, named_tensors: Weights) -> dict:
        """A complete sync through vLLM's weight-transfer engine (untested on GPU, see
        :mod:`.transfer`): the validated weights in the served dtypes, on the vLLM GPU for
        ``ipc`` and where the trainer's tensors are for ``nccl``; a tensor already there in that
        dtype is sent as it is (vLLM reads it during this call, while the training job, whose
        op this sync is, waits), any other is copied. Under ``auto`` a copy that fails (vLLM's
        GPU out of memory: nothing was sent) or a transfer that fails part-way falls back: the
        same weights go through ``reload`` (see the module docstring). A partial sync is refused
        before either, whatever the setting."""
        tensors, report = self._staging.validate(named_tensors, None, copy=False, convert=False)
        if not report["complete"]:
            raise WeightLoadError(
                "weights",
                f"the {self.weight_sync} weight transfer loads every weight, got "
                f"{report['tensors']} tensors; send them all, or set {WEIGHT_SYNC_FIELD} to "
                "'reload' or 'restart' for partial syncs",
            )
        if self._asleep:
            self.wake()
        device = self._transfer.device if self.weight_sync == "ipc" else None
        failure = None  # why ``auto`` falls back
        try:
            sent = self._staging.served(tensors, device)
        except RuntimeError as exc:  # nothing was sent: the served weights are as they were
            if self.weight_sync_requested != "auto":
                raise
            failure = (
                f"copying the weights for the {self.weight_sync} weight transfer failed ({exc})"
            )
        else:
            try:
                self._transfer.send(sent)
            except (EngineInputError, VllmWorkerDied):
                raise  # refused before anything was sent / the job fails with the process
            except RuntimeError as exc:  # vLLM or NCCL failed part-way
                self._weights_complete = False
                failure = f"the {self.weight_sync} weight transfer failed part-way ({exc})"
                if self.weight_sync_requested != "auto":
                    raise SamplerStateError(
                        f"{failure}; the served weights are undefined until a complete weight "
                        "sync succeeds"
                    ) from exc
            finally:
                del sent  # the copies go before a fallback loads the weights again
        if failure is not None:  # out here, so no traceback keeps the copies alive
            self._fall_back(failure)
            return self._load_files(tensors)  # complete weights (named_tensors may be spent)
        self._weights_complete = True
        return {**report, "method": self.weight_sync}

    def _check_weights(self) -> None:
        if not self._weights_complete:
            raise SamplerStateError(
                "the last weight transfer failed part-way, so the served weights are undefined; "
                "run a complete weight sync before generating"
            )

    def sleep(self, level: int = 1) -> dict:
        """vLLM's sleep mode (level 1 offloads the weights, 2 drops them; both drop the KV cache)
        where vLLM has one; on CPU nothing is released and the result says so."""
        if isinstance(level, bool) or level not in (1, 2):
            raise EngineInputError("level", f"must be 1 or 2, got {level!r}")
        if not self.sleep_supported:
            return {
                "level": level,
                "kv_cache_bytes_released": 0,
                "asleep": [],
                "note": f"vLLM has no sleep mode on {self.device.type}; nothing was released",
            }
        self._process.call("sleep", level=level)
        self._asleep = set(SLEEP_TAGS)
        return {"level": level, "asleep": sorted(self._asleep)}

    def wake(self, tags: Sequence[str] | None = None) -> dict:
        """Restore what sleep released: ``tags`` is a subset of ``["weights", "kv_cache"]``."""
        tags = checked_wake_tags(tags)
        woke = [t for t in tags if t in self._asleep]
        if woke:
            self._process.call("wake", tags=woke)
            self._asleep -= set(woke)
        return {"woke": woke, "asleep": sorted(self._asleep)}

    def reset_prefix_cache(self) -> dict:
        """Drop vLLM's cached prompt prefixes (its automatic prefix caching)."""
        return self._process.call("reset_prefix_cache")

    def close(self) -> None:
        """Stop the vLLM process and delete the staged weights."""
        if self._transfer is not None:
            self._transfer.close()
        process, self._process = self._process, None
        if process is not None:
            process.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _vllm_params(request: SampleRequest) -> dict:
    """The request's validated settings as vLLM ``SamplingParams`` keyword arguments."""
    params = dataclasses.asdict(request.params)
    params["stop"] = list(params["stop"])
    params["stop_token_ids"] = list(params["stop_token_ids"])
    params["max_tokens"] = request.max_new
    params["seed"] = request.seed % _SEED_MODULUS
    if request.params.greedy:
        params["n"] = 1  # vLLM refuses n > 1 when greedy: every sample would be the same one
    return params
