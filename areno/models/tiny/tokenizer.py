"""Train a family-shaped tokenizer offline.

A tokenizer trained here uses the target class's own normalizer, pre-tokenizer and decoder, so it
behaves like the family's real tokenizer (byte-level BPE for Qwen / MiniCPM-V, byte-fallback BPE for
Gemma), then is wrapped in the family's tokenizer class with the family's special tokens.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from areno.models.tiny.corpus import corpus


def train_bpe(template: Tokenizer, *, vocab_size: int, byte_fallback: bool) -> tuple[dict, list]:
    """Train BPE with `template`'s pipeline; returns (vocab, merges) for the family class."""
    tok = Tokenizer(models.BPE(byte_fallback=byte_fallback))
    tok.normalizer = template.normalizer
    tok.pre_tokenizer = template.pre_tokenizer
    tok.decoder = template.decoder
    if byte_fallback:
        alphabet: list[str] = []
        special = [f"<0x{b:02X}>" for b in range(256)]
    else:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        special = []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=alphabet,
        special_tokens=special,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    # NOTE: tokenizers' BPE constructor wants merges as tuples, not "a b" strings.
    merges = [
        tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in data["model"]["merges"]
    ]
    return vocab, merges
