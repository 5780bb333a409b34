"""What the server calls on each kind of engine: one ``typing.Protocol`` per sub-job kind.

A sub-job holds one engine: the torch engines of :mod:`arctic_platform.engine` (``TrainingEngine``,
``SamplingEngine`` or vLLM's ``VllmSamplingEngine``, ``LogProbEngine``), the Ray proxies of
``server/ray_engines.py`` standing in for them, or a test's fake (``tests/fake_engine.py``). The
server's op runners (``server/ops.py``), the Tinker runners and the job lifecycle call only the
members below, so any object with them can serve a sub-job, and a generic forwarder (a proxy that
relays each member to where the engine lives) can be written over these classes alone.

They live in the contract, which imports no torch, so the server types its engines without
loading any. Arguments are what the ops hand over: batches are mappings of numpy arrays or torch
tensors (the engine takes either per field), results are the dictionaries that
:mod:`arctic_platform.contract.results` and the op runners shape into answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

# A token-id prompt or a text one; sampling parameters as the contract validates them
# (:mod:`arctic_platform.contract.sampling_params`), one mapping for all prompts or one each.
Prompt: TypeAlias = str | Sequence[int]
SamplingParamsArg: TypeAlias = Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None


@runtime_checkable
class Engine(Protocol):
    """What every engine has: its model's vocabulary and context (the server's edges check
    token ids and row lengths against them before queueing), and ``close``, which releases what
    it holds outside this process (a vLLM process, Ray actors; nothing for an engine that lives
    only here). ``close`` is called once, when the job ends."""

    vocab_size: int
    max_model_len: int

    def close(self) -> None: ...


class WeightSnapshot(Protocol):
    """A trainer's weights at one moment (:meth:`TrainingEngineProtocol.weight_snapshot`)."""

    def load_into(self, sampler: Any) -> dict:
        """Make ``sampler`` (the kind of sampling engine its trainer pairs with) hold these
        weights; the load's report."""
        ...


@runtime_checkable
class TrainingEngineProtocol(Engine, Protocol):
    """A training sub-job's engine (``forward-backward``, ``forward``, ``step``, checkpoints,
    weight sync, colocation; Tinker's training ops)."""

    # Settings the engine could not honour where it runs (a GPU-stack attention, LoRA on a tied
    # output layer), and what it ran instead (reported in the sub-job's ``ignored_settings``).
    setting_fallbacks: Mapping[str, str]

    def forward_backward(
        self,
        batch: Mapping[str, Any] | None,
        meta: Mapping[str, Any] | None = None,
        processing: Mapping[str, Any] | None = None,
        *,
        with_logprobs: bool = False,
    ) -> dict:
        """``{avg_loss, loss, metrics, metric_sums}`` (+ ``logprobs`` ``[B, S]``)."""
        ...

    def forward(
        self,
        batch: Mapping[str, Any] | None,
        meta: Mapping[str, Any] | None = None,
        processing: Mapping[str, Any] | None = None,
    ) -> dict | None:
        """Position-indexed ``logprobs`` ``[B, S]`` (+ ``entropy``, ``metrics``), no gradient."""
        ...

    def step(self, learning_rate: float | None = None, *, adam: Any = None) -> dict:
        """``{grad_norm, last_lr, global_steps, metrics}``."""
        ...

    def save_checkpoint(
        self,
        path: Any = None,
        *,
        step: int | None = None,
        export_hf: bool = False,
        save_total_limit: int | None = None,
    ) -> dict | None:
        """``{path, global_step, checkpoint_id, hf_path}`` of a loadable checkpoint folder."""
        ...

    def load_checkpoint(
        self, path: Any = None, *, step: int | None = None, optimizer: bool = True
    ) -> dict:
        """``{path, global_step, checkpoint_id}`` of the checkpoint restored."""
        ...

    def sync_weights_to(self, target: Any) -> dict:
        """Make sampling engine ``target`` (the kind this trainer pairs with: in this process,
        or a Ray replica) hold this trainer's current weights; the load's report."""
        ...

    def weight_snapshot(self) -> WeightSnapshot:
        """This trainer's weights now, kept for a sampler to load later (Tinker's sampling
        clients sample the weights they were made with while training goes on). What is kept
        depends on where the model lives: in this process, copies of its LoRA adapters; on Ray,
        the merged weights' chunks in the object store."""
        ...

    def sleep(self, mode: str = "all") -> dict: ...

    def wake(self) -> dict: ...

    def empty_cache(self) -> dict: ...


class Tokenizer(Protocol):
    """What the server calls on a model's tokenizer (a Hugging Face one: ``tokenizer(texts,
    add_special_tokens=...)["input_ids"]``, one id list per text)."""

    def __call__(self, text: list[str], *, add_special_tokens: bool = ...) -> Mapping[str, Any]: ...


@runtime_checkable
class SamplingEngineProtocol(Engine, Protocol):
    """A sampling sub-job's engine (``generate``, ``generate-stream``, ``tokenize``, colocation;
    Tinker's ``asample``)."""

    # Whether calls from several threads decode together in one running batch (our sampler with
    # ``continuous_batching``): the server then lets the sub-job's generate ops overlap
    # (``server/sub_job_queue.py``); False runs them one at a time.
    concurrent_generate: bool
    # The model's tokenizer where the engine holds one in this process (ours and vLLM's); None
    # where the model lives elsewhere (the Ray replica, in an actor): ``tokenize`` is then a 400.
    tokenizer: Tokenizer | None

    def generate(
        self, prompts: Sequence[Prompt], sampling_params: SamplingParamsArg = None
    ) -> list[dict]:
        """One dict per prompt and sample, in order: ``token_ids``, ``text``, ``logprobs``,
        ``finish_reason``, ..."""
        ...

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float | None]:
        """The log-prob of each prompt token given those before it (None for the first)."""
        ...

    def sleep(self, level: int = 1) -> dict: ...

    def wake(self, tags: Sequence[str] | None = None) -> dict: ...

    def reset_prefix_cache(self) -> dict: ...


@runtime_checkable
class LogProbEngineProtocol(Engine, Protocol):
    """A log-prob sub-job's engine (``log-probs``, and ``forward`` on a reference model)."""

    # As a sampling engine's: the tokenizer held in this process, or None (the OpenAI API's
    # ``echo`` spells scored tokens with it, else with one loaded from the model's folder).
    tokenizer: Tokenizer | None

    def forward(
        self,
        batch: Mapping[str, Any],
        meta: Mapping[str, Any] | None = None,
        processing: Mapping[str, Any] | None = None,
    ) -> dict:
        """Position-indexed ``logprobs`` ``[B, S]`` (+ ``entropy``), no gradient."""
        ...

    def log_probs(
        self,
        prompts: Sequence[Prompt],
        completions: Sequence[Prompt] | None = None,
        top_k: int = 1,
    ) -> list[dict]:
        """Per prompt: ``prompt_token_ids``, ``completion_token_ids``, ``logprobs``,
        ``top_logprobs``."""
        ...


# What a sub-job's ``engine`` holds, by its kind.
AnyEngine: TypeAlias = "TrainingEngineProtocol | SamplingEngineProtocol | LogProbEngineProtocol"
ENGINE_PROTOCOLS: dict[str, type[Engine]] = {
    "training": TrainingEngineProtocol,
    "sampling": SamplingEngineProtocol,
    "log_prob": LogProbEngineProtocol,
}


def protocol_methods(protocol: type) -> frozenset[str]:
    """The methods ``protocol`` declares, its bases' included: what a forwarder relays to an
    engine of that kind (so a method added to the Protocol is relayed without another list)."""
    return frozenset(
        name
        for klass in protocol.__mro__
        if klass.__module__ == __name__
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("_")
    )
