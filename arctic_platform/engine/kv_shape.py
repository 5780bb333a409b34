"""How much key/value cache one token of a model takes: our sampler's KV cache and vLLM's CPU
budget size themselves from this one reading of a ``transformers`` config."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    """What one token of one sequence holds: per layer, keys and values of ``heads x head_dim``."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model_config, dtype: torch.dtype) -> KVShape:
        """The attention geometry of a ``transformers`` config (its text part), in ``dtype``."""
        cfg = model_config.get_text_config()
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, heads, head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.heads * self.head_dim * self.dtype.itemsize
