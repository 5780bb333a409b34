"""Load causal LMs and tokenizers through the ordinary ``from_pretrained`` path.

Every engine gets its model here, whether the name is a local directory, a hub name or a built-in
model, so built-in models exercise exactly the code path real checkpoints take.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from arctic_platform.engine.builtin import builtin_model_path, is_builtin
from arctic_platform.engine.config import LoraConfig, ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# transformers' model construction is not thread-safe (it patches global init functions and
# resolves its names lazily), and seeding and random weight initialisation use process-global
# generators. Engines built on concurrent threads (one per job on a server) hold this lock around
# those steps; the slow part, reading the files, happens before it (see :func:`read_ahead`).
MODEL_INIT_LOCK = threading.Lock()
READ_AHEAD_BYTES = 16 * 1024 * 1024


def read_ahead(path: str) -> None:
    """Read a local model folder's files once, unlocked, so a slow or stalled disk delays only
    the job that loads from it; ``from_pretrained`` then reads them from the page cache."""
    folder = Path(path)
    if not folder.is_dir():
        return
    for file in sorted(folder.rglob("*")):
        if not file.is_dir():  # a pipe or device that stalls stalls here, unlocked
            with open(file, "rb") as handle:
                while handle.read(READ_AHEAD_BYTES):
                    continue


def resolve_model_path(name: str) -> str:
    """Map a model name to something ``from_pretrained`` accepts (built-ins become paths)."""
    return builtin_model_path(name) if is_builtin(name) else name


def resolve_device(device: str) -> torch.device:
    """``auto`` means the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` means float32 on CPU and bfloat16 on accelerators."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[dtype]


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Bytes of key/value cache one token takes in a ``transformers`` model config's attention
    (every layer's keys and values, in ``dtype``): our sampler's and vLLM's KV budgets."""
    cfg = model_config.get_text_config()
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * dtype.itemsize


def load_tokenizer(config: ModelConfig):
    """Load the tokenizer; a missing pad token falls back to the eos token."""
    with MODEL_INIT_LOCK:
        path = resolve_model_path(config.name)
    read_ahead(path)
    with MODEL_INIT_LOCK:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(config: ModelConfig, device: torch.device | None = None):
    """Load the model described by ``config`` onto ``device``, with LoRA adapters if configured."""
    device = device or resolve_device(config.device)
    with MODEL_INIT_LOCK:
        path = resolve_model_path(config.name)
    read_ahead(path)
    with MODEL_INIT_LOCK:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        # Engines load models inside servers and training loops, whose own progress output the
        # per-load "Loading weights" bars would interleave with.
        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=resolve_dtype(config.dtype, device),
            attn_implementation=config.attn_implementation or "sdpa",
            trust_remote_code=config.trust_remote_code,
        ).to(device)
        if config.lora is not None:
            model = apply_lora(model, config.lora)
    return model


def apply_lora(model, lora: LoraConfig):
    """Wrap ``model`` with peft LoRA adapters; the base weights are frozen by peft."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_config)
