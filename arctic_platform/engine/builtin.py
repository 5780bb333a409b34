"""Built-in models: small HF-format checkpoints created locally, never downloaded.

Tests, the default recipe and the benchmarks need a real model without a model hub. A built-in model
is written once as an ordinary HF directory (``config.json``, safetensors weights, a ``tokenizers``
tokenizer with special tokens and a chat template) under the user cache, keyed by a hash of its
specification, and then loaded by the same ``from_pretrained`` path as any real model. Weights are
randomly initialised with a fixed seed, so every machine builds bit-identical files.

The tokenizer is character level: every printable ASCII character is one token. That keeps the
vocabulary tiny (so the embedding does not dominate a 1 M parameter model) and makes arithmetic and
string tasks learnable by a small model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

BUILTIN_PREFIX = "builtin:"

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|endoftext|>", "<|im_start|>", EOS_TOKEN, "<unk>")
CHARACTERS = string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", "")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Bump when the files a spec produces change, so old cache entries are not reused.
# (Llama rather than Qwen2: transformers forces Qwen2 checkpoints onto its byte-level BPE tokenizer
# class, which would replace our character-level pipeline on load.)
_BUILDER_VERSION = 2


@dataclass(frozen=True)
class BuiltinSpec:
    """Shape of a built-in Llama-style model (grouped-query attention, SwiGLU, RoPE)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    seed: int = 0


BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    # ~0.8 M parameters: tests and the default recipe.
    "tiny": BuiltinSpec(128, 4, 4, 2, 384, 1024),
    # ~25 M parameters: benchmarks, where compute must dominate overheads.
    "small": BuiltinSpec(512, 8, 8, 4, 1536, 4096),
}


def is_builtin(name: str) -> bool:
    """Whether ``name`` refers to a built-in model (``builtin:<size>``)."""
    return name.startswith(BUILTIN_PREFIX)


def unknown_builtin_problem(name: str) -> str | None:
    """What is wrong with built-in model name ``name`` (None: it names one)."""
    if name.removeprefix(BUILTIN_PREFIX) in BUILTIN_MODELS:
        return None
    shown = name if len(name) <= 100 else name[:100] + "..."
    return f"unknown built-in model {shown!r}; known: {_known()}"


def cache_root() -> Path:
    """Where built-in models live: ``$ARCTIC_PLATFORM_CACHE`` or ``~/.cache/arctic-platform``."""
    env = os.environ.get("ARCTIC_PLATFORM_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "arctic-platform"


def builtin_model_path(name: str) -> str:
    """Return the directory of built-in model ``name`` (``builtin:tiny``), creating it once."""
    size = name[len(BUILTIN_PREFIX) :] if is_builtin(name) else name
    spec = BUILTIN_MODELS.get(size)
    if spec is None:
        raise ValueError(unknown_builtin_problem(name))
    return cached_model_folder(
        size, {"spec": asdict(spec), "v": _BUILDER_VERSION}, lambda d: _write_model(spec, d)
    )


def cached_model_folder(stem: str, identity: dict, write: Callable[[Path], None]) -> str:
    """The folder ``<cache>/models/<stem>-<hash of identity>``, filled by ``write(folder)`` once.

    ``write`` fills a staging folder that is then renamed into place, so a half-written model is
    never found and concurrent builders of the same identity (whose files are identical) are safe.
    """
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{stem}-{key}"
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{stem}-", dir=target.parent))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first; its files are identical to ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def resolve_model_path(name: str) -> str:
    """Map a model name to something ``from_pretrained`` accepts (built-ins become paths)."""
    return builtin_model_path(name) if is_builtin(name) else name


def build_tokenizer():
    """Build the character-level fast tokenizer shared by every built-in model."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    # A BPE model without merges splits text into single characters; unknown ones map to <unk>.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token="<unk>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _write_model(spec: BuiltinSpec, directory: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in (EOS_TOKEN, "<|endoftext|>")]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_ids[0],
        bos_token_id=None,
        initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def export_builtin_model(name: str, destination: str | os.PathLike) -> Path:
    """Copy built-in model ``name`` into ``destination`` (a new folder) as a plain HF model.

    Frameworks that load the model themselves (verl's trainer reads the tokenizer and config from
    ``actor_rollout_ref.model.path``) need a real folder, not a ``builtin:`` name.
    """
    if not is_builtin(name):
        raise ValueError(f"{name!r}: only builtin: models need exporting; known: {_known()}")
    target = Path(destination)
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"{target}: exists and is not empty; choose a new folder")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copytree(builtin_model_path(name), target, dirs_exist_ok=True)
    return target


def _known() -> str:
    return ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_MODELS)
