"""Pieces every tiny-checkpoint builder shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import transformers as tf

from areno.models.tiny.tokenizer import train_bpe

VOCAB_SIZE = 600  # BPE merges learned from the corpus; special tokens come on top


@dataclass
class TinyParts:
    """A built tiny checkpoint, before it is written to disk."""

    model: tf.PreTrainedModel
    processor: tf.ProcessorMixin
    eos_tokens: list[str] = field(default_factory=list)


def load_template(name: str) -> str:
    return resources.files("areno.models.tiny").joinpath(f"templates/{name}.jinja").read_text()


def train_tokenizer(
    tokenizer_class: type,
    *,
    byte_fallback: bool,
    ctor_kwargs: dict,
    special_tokens: list[str],
    named_tokens: dict[str, str],
    base_vocab: dict[str, int] | None = None,
) -> tf.PreTrainedTokenizerBase:
    """Train BPE with `tokenizer_class`'s pipeline and add the family's special tokens.

    `named_tokens` become tokenizer attributes (`tok.image_token`, `tok.image_token_id`, ...),
    which the families' processors read; they are saved in tokenizer_config.json.
    """
    template = tokenizer_class()._tokenizer
    vocab, merges = train_bpe(template, vocab_size=VOCAB_SIZE, byte_fallback=byte_fallback)
    if base_vocab:
        # Fixed ids first (Gemma's <pad>=0 <eos>=1 ...), learned tokens after them.
        learned = [t for t in sorted(vocab, key=vocab.get) if t not in base_vocab]
        vocab = dict(base_vocab) | {t: len(base_vocab) + i for i, t in enumerate(learned)}
    tok = tokenizer_class(vocab=vocab, merges=merges, **ctor_kwargs)
    tok.add_special_tokens({"additional_special_tokens": special_tokens})
    tok._set_model_specific_special_tokens(named_tokens)
    return tok


def save_tiny(parts: TinyParts, out_dir: Path) -> Path:
    """Write model, processor and generation config so the Auto classes reload them."""
    tok = parts.processor.tokenizer
    eos_ids = [tok.convert_tokens_to_ids(t) for t in parts.eos_tokens]
    parts.model.generation_config = tf.GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=tok.pad_token_id, do_sample=False
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    parts.model.save_pretrained(out_dir)
    parts.processor.save_pretrained(out_dir)
    return out_dir
