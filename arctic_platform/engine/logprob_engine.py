"""The frozen reference model: ``fwd_no_grad(reference_model=True)`` and the ``log-probs`` op.

It scores tokens through exactly the code the training engine uses
(:func:`arctic_platform.engine.forward.forward_no_grad`), so reference log-probs and policy
log-probs of the same weights agree bit for bit and KL terms start at zero. The model never
trains: parameters have ``requires_grad=False`` and it stays in eval mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from arctic_platform.contract.bodies import context_problem, prompts_problem
from arctic_platform.engine.chunked_head import LMHead
from arctic_platform.engine.config import LogitsSettings, ModelConfig, SamplingEngineConfig
from arctic_platform.engine.errors import EngineInputError
from arctic_platform.engine.forward import Request, check_top_k, forward_no_grad, prepare_request
from arctic_platform.engine.models import load_causal_lm, load_tokenizer, resolve_device
from arctic_platform.engine.trainer import seed_everything

_DEFAULT_MAX_TOKENS = 16384


class LogProbEngine:
    """A frozen causal LM that scores tokens (see module doc).

    Built from a :class:`SamplingEngineConfig` (its ``max_tokens_per_microbatch``,
    ``max_model_len``, ``prompt_sharing``, ``logits`` and ``seed`` apply) or a bare
    :class:`ModelConfig`.
    """

    def __init__(self, config: SamplingEngineConfig | ModelConfig) -> None:
        if isinstance(config, SamplingEngineConfig):
            model_config, seed = config.model, config.seed
            self.max_tokens = config.max_tokens_per_microbatch
            self.prompt_sharing = config.prompt_sharing
            max_model_len = config.max_model_len
            logits = config.logits
        else:
            model_config, seed = config, 0
            self.max_tokens = _DEFAULT_MAX_TOKENS
            self.prompt_sharing = "auto"
            max_model_len = None
            logits = LogitsSettings()
        self.model_config = model_config
        self.device = resolve_device(model_config.device)
        seed_everything(seed)
        self.model = load_causal_lm(model_config, self.device).eval()
        self.model.requires_grad_(False)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self._head = LMHead.of(self.model, logits)
        self.max_model_len = max_model_len or int(
            getattr(self.model.config, "max_position_embeddings", 0) or 2**31 - 1
        )
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The model's tokenizer, loaded on first use (only text prompts need it)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_config)
        return self._tokenizer

    def forward(
        self, batch: Mapping, meta: Mapping | None = None, processing: Mapping | None = None
    ) -> dict:
        """Same contract as :meth:`TrainingEngine.forward`: position-indexed ``[B, S]`` outputs."""
        request = self._prepare(batch, meta, processing)
        return forward_no_grad(self.model, request, self.device, head=self._head)

    def log_probs(
        self,
        prompts: Sequence[str | Sequence[int]],
        completions: Sequence[str | Sequence[int]] | None = None,
        top_k: int = 1,
    ) -> list[dict]:
        """Per-token log-probs of each completion given its prompt, with the top-``k`` tokens.

        Prompts and completions are texts (tokenised with the model's tokenizer; completions
        without special tokens) or token-id lists. One dict per prompt: ``prompt_token_ids``,
        ``completion_token_ids``, ``logprobs`` (one float per completion token) and
        ``top_logprobs`` (per completion token, ``[[token_id, logprob], ...]`` best first). With
        ``completions=None`` the prompt tokens themselves are scored and, as in vLLM's
        ``prompt_logprobs``, the first token's entries are None.
        """
        top_k = check_top_k(top_k, self.vocab_size)
        prompt_ids, completion_ids = self._tokenize(prompts, completions)
        rows = [p + c for p, c in zip(prompt_ids, completion_ids, strict=True)]
        width = max(len(r) for r in rows)
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, : len(row)] = 1
        request = self._prepare({"input_ids": input_ids, "attention_mask": attention_mask})
        out = forward_no_grad(self.model, request, self.device, top_k=top_k, head=self._head)
        results = []
        for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
            start = len(prompt) if completions is not None else 0
            span = range(start, len(prompt) + len(completion))
            logprobs = [float(out["logprobs"][i, t]) for t in span]
            tops = [_top_list(out, i, t, top_k) for t in span]
            if completions is None:
                logprobs[0] = tops[0] = None
            results.append(
                {
                    "prompt_token_ids": prompt,
                    "completion_token_ids": completion,
                    "logprobs": logprobs,
                    "top_logprobs": tops,
                }
            )
        return results

    def close(self) -> None:
        """Nothing to release outside this process: the model goes with the engine."""

    def _prepare(self, batch: Mapping, meta=None, processing=None) -> Request:
        """A scoring request (a loss only when ``processing`` names one), packed by token budget."""
        return prepare_request(
            batch,
            meta,
            processing,
            vocab_size=self.vocab_size,
            max_tokens=self.max_tokens,
            packing=True,
            default_loss=None,
            max_seq_len=self.max_model_len,
            prompt_sharing=self.prompt_sharing,
        )

    def _tokenize(self, prompts, completions) -> tuple[list[list[int]], list[list[int]]]:
        """Token ids of the prompts and completions, whose shape is the contract's rule
        (:func:`arctic_platform.contract.bodies.prompts_problem`); vocabulary and context are
        checked here."""
        for name, values in (("prompts", prompts), ("completions", completions)):
            problem = None if values is None else prompts_problem(values, name=name)
            if problem is not None:
                raise EngineInputError(problem.field, problem.message)
        if completions is not None and len(completions) != len(prompts):
            raise EngineInputError(
                "completions", f"expected a list with one entry per prompt ({len(prompts)})"
            )
        prompt_ids = [self._ids(f"prompts[{i}]", p, special=True) for i, p in enumerate(prompts)]
        if completions is None:
            completion_ids = [[] for _ in prompts]
        else:
            completion_ids = [
                self._ids(f"completions[{i}]", c, special=False) for i, c in enumerate(completions)
            ]
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
            if not p:
                raise EngineInputError(f"prompts[{i}]", "is empty")
            problem = context_problem(
                f"prompts[{i}]", "prompt + completion", len(p) + len(c), self.max_model_len
            )
            if problem is not None:
                raise EngineInputError(problem.field, problem.message)
        return prompt_ids, completion_ids

    def _ids(self, field: str, value, *, special: bool) -> list[int]:
        if isinstance(value, str):
            return list(self.tokenizer(value, add_special_tokens=special)["input_ids"])
        ids = list(value)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise EngineInputError(field, f"token ids must lie in [0, {self.vocab_size})")
        return ids


def _top_list(out: dict, row: int, col: int, k: int) -> list[list]:
    if not k:
        return []
    ids = out["top_ids"][row, col].tolist()
    values = out["top_logprobs"][row, col].tolist()
    return [[int(t), float(v)] for t, v in zip(ids, values, strict=True)]
