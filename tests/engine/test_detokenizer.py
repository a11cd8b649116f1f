"""IncrementalDetokenizer must stream exactly what `tokenizer.decode` gives for the whole output,
and give the same text from one decode at the end (`decode_rest`)."""

from __future__ import annotations

import random

import pytest
from tokenizers import decoders
from transformers import AutoTokenizer

from areno.engine.outputs.detokenizer import NUM_SEED_TOKENS, IncrementalDetokenizer

FAMILIES = ["qwen3_5", "qwen3_vl", "gemma4", "minicpmv4_6"]
TEXTS = [
    "Hello world!\nThe answer is 42.  Two spaces,\n\n\ttab and newlines.",
    "café naïve résumé Ångström",
    "你好世界",
    "👍🏽🎉",
    "Mixed: 价格 is 9.99€ 👍🏽 — naïve café, done.\n",
    " leading space",
]
PROMPT = "User: say something\nAssistant:"


@pytest.fixture(scope="module", params=FAMILIES)
def tokenizer(request: pytest.FixtureRequest, tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path(request.param))


def stream(tokenizer, prompt_ids: list[int], output_ids: list[int], *, skip: bool = True):
    """Feed `output_ids` one at a time; returns (add() returns, flush() return, final text).
    Every case also checks that one `decode_rest` of them gives that same text."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    pieces = [detok.add(token_id) for token_id in output_ids]
    tail = detok.flush()
    plain = getattr(tokenizer, "wrapped", tokenizer)  # not through a DecodeSpy
    once = IncrementalDetokenizer(plain, prompt_ids, skip_special_tokens=skip)
    assert once.decode_rest(output_ids) == "".join(pieces) + tail == detok.text
    return pieces, tail, detok.text


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("with_prompt", [False, True])
def test_encoded_text_streams_to_full_decode(tokenizer, text: str, with_prompt: bool) -> None:
    prompt_ids = encode(tokenizer, PROMPT) if with_prompt else []
    output_ids = encode(tokenizer, text)
    pieces, tail, final = stream(tokenizer, prompt_ids, output_ids)
    expected = tokenizer.decode(output_ids, skip_special_tokens=True)
    assert "".join(pieces) + tail == expected == final
    # Held-back bytes must never leak out as replacement characters mid-stream.
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_stream_to_full_decode(tokenizer, skip: bool) -> None:
    rng = random.Random(0)
    vocab = range(len(tokenizer))  # includes the added special tokens
    for _ in range(40):
        prompt_ids = rng.choices(vocab, k=rng.randint(0, 8))
        output_ids = rng.choices(vocab, k=rng.randint(1, 40))
        pieces, tail, final = stream(tokenizer, prompt_ids, output_ids, skip=skip)
        expected = tokenizer.decode(output_ids, skip_special_tokens=skip)
        assert "".join(pieces) + tail == expected == final, (prompt_ids, output_ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_token_inside_multibyte_character(tokenizer, skip: bool) -> None:
    # A special token between the bytes of one character: skipped, the bytes still join up.
    # Every added token flagged special counts, not only `all_special_ids` (Gemma 4's <|turn>).
    char_ids = encode(tokenizer, "你好")
    special_ids = [i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special]
    for special_id in special_ids:
        output_ids = char_ids[:1] + [special_id] + char_ids[1:] + [special_id]
        pieces, tail, _ = stream(tokenizer, encode(tokenizer, PROMPT), output_ids, skip=skip)
        expected = tokenizer.decode(output_ids, skip_special_tokens=skip)
        assert "".join(pieces) + tail == expected, special_id
        if skip:
            assert expected == "你好"


def test_prompt_ending_mid_character_does_not_swallow_output(tokenizer) -> None:
    # The output must read as decode(output_ids), so its first bytes may not complete the
    # prompt's last character (nor join the prompt's trailing byte-fallback run).
    prompt_ids = encode(tokenizer, PROMPT + " 你")[:-1]
    assert tokenizer.decode(prompt_ids).endswith("\ufffd")
    output_ids = encode(tokenizer, " 你")[-1:] + encode(tokenizer, "!")
    pieces, tail, _ = stream(tokenizer, prompt_ids, output_ids)
    assert "".join(pieces) + tail == tokenizer.decode(output_ids) == "\ufffd!"


def test_first_token_keeps_its_space_after_prompt(tokenizer) -> None:
    output_ids = encode(tokenizer, " world, again")
    assert tokenizer.decode(output_ids[:1]).startswith(" ")
    pieces, tail, _ = stream(tokenizer, encode(tokenizer, "Hello"), output_ids)
    assert pieces[0].startswith(" ")
    assert "".join(pieces) + tail == " world, again"


def test_prompt_seed_restores_space_sentencepiece_strips(tiny_path) -> None:
    # Llama-style SentencePiece decoders strip the space a decode starts with; the prompt seed
    # keeps it for the output's first token, as it reads after the prompt.
    tokenizer = AutoTokenizer.from_pretrained(tiny_path("gemma4"))
    backend = tokenizer.backend_tokenizer
    backend.decoder = decoders.Sequence([backend.decoder, decoders.Strip(" ", 1, 0)])
    output_ids = encode(tokenizer, " world")
    assert tokenizer.decode(output_ids) == "world"
    pieces, tail, _ = stream(tokenizer, encode(tokenizer, "Hello"), output_ids)
    assert "".join(pieces) + tail == " world"
    pieces, tail, _ = stream(tokenizer, [], output_ids)  # no context: same as a full decode
    assert "".join(pieces) + tail == "world"


class DecodeSpy:
    """Wraps a tokenizer and records the longest id list any decode call saw."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = self.wrapped = tokenizer
        self.max_decode_len = 0

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def decode(self, token_ids: list[int], **kwargs) -> str:
        self.max_decode_len = max(self.max_decode_len, len(token_ids))
        return self._tokenizer.decode(token_ids, **kwargs)


def test_decode_window_stays_short(tokenizer) -> None:
    # Per-token cost must not grow with the output: every decode sees only a short window.
    output_ids = encode(tokenizer, "The quick brown fox 👍🏽 jumps over naïve dogs.\n" * 40)
    spy = DecodeSpy(tokenizer)
    pieces, tail, _ = stream(spy, encode(tokenizer, PROMPT), output_ids)
    assert "".join(pieces) + tail == tokenizer.decode(output_ids, skip_special_tokens=True)
    assert len(output_ids) > 500
    assert spy.max_decode_len <= NUM_SEED_TOKENS + 8
