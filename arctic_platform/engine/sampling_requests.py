"""A ``generate`` call turned into validated requests, the same way for every sampling backend.

Both backends (our torch sampler and the vLLM process) take the same prompts and the same
vLLM-style sampling dictionaries, and must reject the same bad calls with the same errors naming
the field. So validation lives here, once: prompts (strings tokenized with the model's tokenizer,
or token ids checked against the vocabulary), each request's :class:`SamplingParams`, the context
length (``max_tokens`` defaults to what is left of ``max_model_len``), ``logprobs`` against the
engine's cap and ``min_tokens`` against the tokens left. A backend may add checks of its own
(the torch sampler's KV cache budget) before it calls :meth:`RequestShaper.assign_seeds`.

Seeds: a request without a ``seed`` draws one from the shaper's generator (seeded by the engine's
``seed``) only after the whole call was validated, so a rejected call leaves the stream untouched
and a fixed sequence of calls repeats run to run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from arctic_platform.contract.bodies import context_problem, prompts_problem
from arctic_platform.contract.sampling_params import SamplingParams
from arctic_platform.engine.config import SamplingEngineConfig
from arctic_platform.engine.errors import EngineInputError


@dataclass
class SampleRequest:
    """One prompt of a call: its token ids, settings and the new tokens it may produce."""

    index: int
    token_ids: list[int]
    params: SamplingParams
    max_new: int
    seed: int = 0  # drawn only once the whole call has been validated


class RequestShaper:
    """Validates ``generate`` calls against one model's tokenizer, vocabulary and context."""

    def __init__(
        self, tokenizer, config: SamplingEngineConfig, *, vocab_size: int, max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = config.max_logprobs
        self._seed_rng = torch.Generator().manual_seed(config.seed)

    def validate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: Mapping | SamplingParams | Sequence[Mapping | None] | None,
    ) -> list[SampleRequest]:
        """The call's requests in prompt order; a :class:`FieldError` names a bad field.

        The prompts' shape is the contract's rule
        (:func:`arctic_platform.contract.bodies.prompts_problem`; 1-D integer tensors count as
        token-id lists); the vocabulary and the context are checked here.
        """
        if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
            prompts = [_token_list(p) for p in prompts]
        problem = prompts_problem(prompts)
        if problem is not None:
            raise EngineInputError(problem.field, problem.message)
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            if len(sampling_params) != len(prompts):
                raise EngineInputError(
                    "sampling_params",
                    f"{len(sampling_params)} entries for {len(prompts)} prompts; give one "
                    "dictionary for all prompts or one per prompt",
                )
            fields = [f"sampling_params[{i}]" for i in range(len(prompts))]
            parse = SamplingParams.from_request
            params = [parse(p, f) for p, f in zip(sampling_params, fields, strict=True)]
        else:
            fields = ["sampling_params"] * len(prompts)
            params = [SamplingParams.from_request(sampling_params, fields[0])] * len(prompts)
        token_ids = self._tokenize(prompts)
        return [
            self._check(i, ids, p, f)
            for i, (ids, p, f) in enumerate(zip(token_ids, params, fields, strict=True))
        ]

    def assign_seeds(self, requests: list[SampleRequest]) -> None:
        """Give each request its own seed, or one drawn from the engine's stream."""
        for request in requests:
            seed = request.params.seed
            if seed is None:
                seed = int(torch.randint(-(2**62), 2**62, (), generator=self._seed_rng))
            request.seed = seed

    def _tokenize(self, prompts: Sequence) -> list[list[int]]:
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        encoded = (
            self.tokenizer([prompts[i] for i in texts], add_special_tokens=False)["input_ids"]
            if texts
            else []
        )
        result: list[list[int]] = []
        by_index = dict(zip(texts, encoded, strict=True))
        for i, prompt in enumerate(prompts):
            field = f"prompts[{i}]"
            ids = list(by_index[i]) if i in by_index else list(prompt)
            if not ids:
                raise EngineInputError(field, "empty prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise EngineInputError(
                    field, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
            result.append(ids)
        return result

    def _check(self, index: int, ids: list[int], params: SamplingParams, field: str):
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise EngineInputError(
                f"{field}.stop_token_ids",
                f"{bad[0]} is outside the vocabulary of {self.vocab_size}",
            )
        limit = min(self.max_logprobs, self.vocab_size)
        if params.logprobs is not None and params.logprobs > limit:
            raise EngineInputError(f"{field}.logprobs", f"at most {limit}, got {params.logprobs}")
        length = len(ids)
        max_new = params.max_tokens or self.max_model_len - length
        problem = context_problem(
            f"prompts[{index}]",
            f"a prompt of {length} tokens plus max_tokens={max_new}",
            length + max(max_new, 1),
            self.max_model_len,
        )
        if problem is not None:
            raise EngineInputError(problem.field, problem.message)
        if params.min_tokens > max_new:
            raise EngineInputError(
                f"{field}.min_tokens", f"{params.min_tokens} exceeds the {max_new} tokens left"
            )
        return SampleRequest(index, ids, params, max_new)


def _token_list(prompt):
    """A 1-D integer tensor prompt as its token-id list; anything else as it is."""
    if isinstance(prompt, torch.Tensor) and prompt.ndim == 1 and not prompt.is_floating_point():
        return prompt.tolist()
    return prompt


def model_context(model_config) -> int:
    """The context length (``max_position_embeddings``) of a ``transformers`` model config."""
    return model_config.get_text_config().max_position_embeddings


def checked_max_model_len(requested: int | None, context: int) -> int:
    """``max_model_len`` of an engine: the requested bound, which may not exceed the model's."""
    if requested is not None and requested > context:
        raise EngineInputError(
            "max_model_len", f"{requested} exceeds the model's context of {context} positions"
        )
    return requested or context
