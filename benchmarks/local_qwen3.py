"""A Qwen3-architecture model with the real 151,936-token vocabulary, built locally (no hub).

Benchmarks at real size need the real vocabulary (where the logits dominate memory) without a
download: :func:`qwen3_model_path` writes an ordinary HF folder (``config.json``, safetensors
weights drawn with a fixed seed, tied embeddings) with a byte-level BPE tokenizer trained here, by
the ``tokenizers`` library, on this repository's own documentation. The tokenizer's vocabulary is
smaller than the model's, as Qwen3's own is (151,669 tokens for 151,936 embedding rows). Folders
are cached under the built-in models' cache, keyed by their shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from arctic_platform.engine.builtin import cached_model_folder

QWEN3_VOCAB = 151_936
TOKENIZER_VOCAB = 8_192
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
REPO = Path(__file__).resolve().parent.parent
# Bump when the files a shape produces change, so old cache entries are not reused.
_BUILDER_VERSION = 1


@dataclass(frozen=True)
class Qwen3Shape:
    """Qwen3-0.6B's proportions (head dim 128, MLP 3x hidden, grouped-query attention 2:1) at a
    chosen depth and width."""

    layers: int = 4
    hidden: int = 1024
    vocab: int = QWEN3_VOCAB
    seed: int = 0

    @property
    def heads(self) -> int:
        return max(1, self.hidden // 64)


def qwen3_model_path(shape: Qwen3Shape) -> str:
    """The folder of the model ``shape`` describes, written once."""
    return cached_model_folder(
        f"qwen3-{shape.layers}x{shape.hidden}",
        {"shape": asdict(shape), "v": _BUILDER_VERSION},
        lambda folder: _write(shape, folder),
    )


def train_tokenizer():
    """A byte-level BPE tokenizer trained on this repository's Markdown files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = sorted(p for p in REPO.rglob("*.md") if ".venv" not in p.parts)
    core.train([str(p) for p in corpus], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )


def _write(shape: Qwen3Shape, directory: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = train_tokenizer()
    config = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=3 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=max(1, shape.heads // 2),
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
