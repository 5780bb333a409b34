"""Load causal LMs and tokenizers through the ordinary ``from_pretrained`` path.

Every engine gets its model here, whether the name is a local directory, a hub name or a built-in
model, so built-in models exercise exactly the code path real checkpoints take.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from pathlib import Path

import torch

from arctic_platform.engine.builtin import builtin_model_path, is_builtin
from arctic_platform.engine.config import LoraConfig, ModelConfig
from arctic_platform.engine.model_files import fetch_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger(__name__)
# Attention implementations that need a GPU stack beyond torch (a package, a CUDA device): the
# module each imports and the package that installs it. A hub kernel
# (``kernels-community/flash-attn2``, any name with a ``/``) needs the ``kernels`` package.
GPU_STACK_ATTENTION = {
    "flash_attention_2": ("flash_attn", "flash_attn"),
    "flash_attention_3": ("flash_attn_interface", "flash_attn_3"),
    "flash_attention_4": ("flash_attn", "flash_attn_4"),
}
HUB_KERNELS = ("kernels", "kernels")


# transformers' model construction is not thread-safe (it patches global init functions and
# resolves its names lazily), and seeding and random weight initialisation use process-global
# generators. Engines built on concurrent threads (one per job on a server) hold this lock around
# those steps; the slow parts, downloading a hub model (:func:`local_model_path`) and reading the
# files (:func:`read_ahead`), happen before it.
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


def local_model_path(name: str) -> str:
    """The local folder of model ``name``: a built-in is written once (under the lock: building
    it initialises a model), a hub name downloaded unlocked (:func:`fetch_model`)."""
    if is_builtin(name):
        with MODEL_INIT_LOCK:
            return builtin_model_path(name)
    return fetch_model(name)


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


def use_shape_stable_attention(device: torch.device) -> None:
    """On CUDA, stop SDPA from choosing cuDNN's attention kernels (process-wide, once).

    cuDNN builds an execution plan for every new attention shape, about 1.7 ms of CPU time per
    layer on an H200 (torch 2.11), while the kernel itself then runs for ~20 us. An RL engine
    meets a new shape at every decode step (the key length grows by one) and at nearly every
    training batch (sequence lengths vary), so on a 28-layer model that was ~47 ms of a ~95 ms
    decode step. SDPA's flash and memory-efficient kernels take any shape without planning.
    The flag is global to the process, so it is set once, before any engine's first forward,
    rather than toggled around calls that other threads' engines may be running beside."""
    if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("SDPA's cuDNN backend is off: it plans per shape, and RL shapes keep changing")


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Bytes of key/value cache one token takes in a ``transformers`` model config's attention
    (every layer's keys and values, in ``dtype``): our sampler's and vLLM's KV budgets."""
    cfg = model_config.get_text_config()
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * dtype.itemsize


def load_tokenizer(config: ModelConfig):
    """Load the tokenizer; a missing pad token falls back to the eos token."""
    path = local_model_path(config.name)
    read_ahead(path)
    with MODEL_INIT_LOCK:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def needs_gpu_stack(attn_implementation: str | None) -> bool:
    """Whether ``attn_implementation`` is a GPU-stack one (flash attention, a hub kernel)."""
    if attn_implementation is None:
        return False
    base = attn_implementation.rsplit("|", 1)[-1]  # "paged|flash_attention_2"
    return base in GPU_STACK_ATTENTION or "/" in base


def load_causal_lm(
    config: ModelConfig,
    device: torch.device | None = None,
    *,
    fallbacks: dict[str, str] | None = None,
):
    """Load the model described by ``config`` onto ``device``, with LoRA adapters if configured.

    A GPU-stack attention implementation (:func:`needs_gpu_stack`) that cannot run here (its
    package is missing, no CUDA device) degrades instead of failing the job: the model keeps
    transformers' default (``sdpa``, or ``eager`` for a model without sdpa), the fallback is
    logged and written into ``fallbacks`` as ``{"attn_implementation": "flash_attention_2 ->
    sdpa (flash_attn is not installed)"}``. Frameworks tuned for GPUs (SkyRL's Arctic
    integration defaults to ``flash_attention_2``) then run on any machine.
    """
    device = device or resolve_device(config.device)
    use_shape_stable_attention(device)
    requested = config.attn_implementation
    on_gpu_stack = needs_gpu_stack(requested)
    path = local_model_path(config.name)
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
            # None: transformers' default (sdpa, else eager); a GPU stack is tried once loaded
            attn_implementation=None if on_gpu_stack else (requested or "sdpa"),
            trust_remote_code=config.trust_remote_code,
        ).to(device)
        if on_gpu_stack:
            fallback = _try_attention(model, requested)
            if fallback is not None:
                log.warning("%s: attn_implementation: %s", config.name, fallback)
                if fallbacks is not None:
                    fallbacks["attn_implementation"] = fallback
        if config.lora is not None:
            model = apply_lora(model, config.lora, fallbacks)
    return model


def _try_attention(model, requested: str) -> str | None:
    """Switch the loaded ``model`` to ``requested`` through transformers' own checks (package,
    version, device, model support); None when it took, else ``"requested -> used (why)"``."""
    reason = "chosen by transformers"
    try:
        model.set_attn_implementation(requested)
    except (ImportError, ValueError, OSError) as exc:  # its refusals, or a hub kernel not fetched
        reason = _why_not(requested, exc)
    used = model.config._attn_implementation
    return None if used == requested else f"{requested} -> {used} ({reason})"


def _why_not(requested: str, exc: BaseException) -> str:
    """The short reason a GPU-stack attention implementation cannot run: the missing package
    when that is the cause, else transformers' own words (after its "the following error:")."""
    base = requested.rsplit("|", 1)[-1]
    module, package = HUB_KERNELS if "/" in base else GPU_STACK_ATTENTION[base]
    if importlib.util.find_spec(module) is None:
        return f"{package} is not installed"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.rsplit("error:", 1)[-1].strip()


def apply_lora(model, lora: LoraConfig, fallbacks: dict[str, str] | None = None):
    """Wrap ``model`` with peft LoRA adapters; the base weights are frozen by peft.

    ``train_unembed`` adds the output layer to the targets. peft's ``all-linear`` leaves that
    layer out and cannot be combined with a name, so it is spelled out as the names of every
    other linear layer. An output layer tied to the input embedding is not adapted: its merged
    weights could not be exported (the embedding would have to change with it), so the model
    trains without it, logged and written into ``fallbacks`` (the job's ``ignored_settings``).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = lora.target_modules
    if lora.train_unembed:
        head = model.get_output_embeddings()
        if head.weight is model.get_input_embeddings().weight:
            why = (
                "not applied: the output layer shares the input embedding's weights "
                "(tie_word_embeddings), adapters on the other layers only"
            )
            log.warning("lora.train_unembed: %s", why)
            if fallbacks is not None:
                fallbacks["lora.train_unembed"] = why
        else:
            targets = _with_output_layer(model, head, targets)
    peft_config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_config)


def _with_output_layer(model, head: torch.nn.Module, targets) -> list[str]:
    """``targets`` (a list of module names, or ``all-linear``: every linear layer's name but the
    output layer's) with the output layer's name added."""
    from transformers.pytorch_utils import Conv1D

    names = dict(model.named_modules())
    head_name = next(name for name, module in names.items() if module is head)
    if targets == "all-linear":
        targets = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in names.items()
                if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not head
            }
        )
    return [*targets, head_name]
