"""The reasoning splitter: a reply that began inside a `<think>` block, whole and streamed, and
the prompt check that decides whether a reply begins inside one."""

from __future__ import annotations

import random

import pytest

from areno.tools import ReasoningStream, opens_reasoning, split_reasoning
from tests.tools.helpers import random_pieces

# (reply text after a generation prompt that opened `<think>\n`, reasoning, content)
CASES = [
    ("I should zoom.\n</think>\n\nThe answer is 4.", "I should zoom.", "The answer is 4."),
    ("Two lines\n\nof thought.\n</think>\n\nA\n\nB\n", "Two lines\n\nof thought.", "A\n\nB\n"),
    ("\n</think>\n\nNo reasoning at all.", "", "No reasoning at all."),
    ("\n</think>\n\n", "", ""),
    ("Cut off by max_tokens, never closed\n", "Cut off by max_tokens, never closed", ""),
    ("Ends in a partial tag </thi", "Ends in a partial tag </thi", ""),
    ("x</think>y</think>z", "x", "y</think>z"),  # only the first end tag closes the block
    ("", "", ""),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_split_reasoning(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


def stream_split(pieces: list[str]) -> tuple[str, str]:
    """Feed `pieces` to a ReasoningStream and accumulate what it emits, as a client does."""
    stream = ReasoningStream()
    reasoning, content = "", ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    return reasoning + stream.finish(), content


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_streaming_in_any_pieces_matches_the_whole_split(text, reasoning, content):
    """Token by token (here: character by character, so `</think>` is split every way), random
    pieces, and every two-piece cut all give the whole reply's split."""
    rng = random.Random(0)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in [list(text), *(random_pieces(text, rng) for _ in range(5)), *cuts]:
        assert stream_split(pieces) == (reasoning, content), pieces


def test_a_split_end_tag_is_held_back_until_decided():
    stream = ReasoningStream()
    assert stream.feed("\nLet me think.\n</th") == ("Let me think.", "")
    assert stream.feed("ink") == ("", "")
    assert stream.feed(">\n\nParis") == ("", "Paris")
    assert stream.feed(".") == ("", ".")
    assert stream.finish() == ""


def test_what_looked_like_a_tag_is_released_as_reasoning():
    stream = ReasoningStream()
    assert stream.feed("a </") == ("a ", "")
    assert stream.feed("b>\n") == ("</b>", "")  # the newline may still precede the end tag
    assert stream.feed("c") == ("\nc", "")
    assert stream.finish() == ""


def test_a_block_never_closed_is_all_reasoning():
    stream = ReasoningStream()
    assert stream.feed("Still thinking\n") == ("Still thinking", "")
    assert stream.feed("</think") == ("", "")
    assert stream.finish() == "\n</think"  # generation ended: the partial tag was text


@pytest.fixture(scope="module")
def qwen_tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path("qwen3_5"))


def render(tokenizer, **kwargs) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False, **kwargs
    )


def test_the_rendered_prompt_decides_whether_a_reply_starts_in_reasoning(qwen_tokenizer):
    """Qwen3.5's generation prompt opens a block; enable_thinking=false renders it closed."""
    assert opens_reasoning(render(qwen_tokenizer))
    assert not opens_reasoning(render(qwen_tokenizer, enable_thinking=False))
    assert not opens_reasoning("<|im_start|>assistant\n")
    assert opens_reasoning("<start_of_turn>model\n<think>")  # any template, any family
    assert not opens_reasoning("<think>\nold\n</think>\n\n<|im_start|>assistant\n")
