"""Reasoning blocks: the `<think>...</think>` text of a thinking checkpoint, split from its reply.

A thinking chat template (Qwen3.5's and others) ends the generation prompt with an open `<think>`
block, so the model writes `reasoning</think>reply` and the end tag would otherwise leak into
`content` (and into the tool-call parser). As vLLM's reasoning parsers do, the text before the end
tag becomes `message.reasoning_content` and only the rest is content. Whether a reply starts
inside a block is read from the rendered prompt (`opens_reasoning`), never from the family name:
any template that leaves a block open gets the split, and `enable_thinking=false` (which renders
a closed, empty block) does not.

Whitespace: the newlines a template writes around the block (`<think>\\n`, `\\n</think>\\n\\n`)
are separators, not text: reasoning drops them at both ends and content at its start, which is
what the template strips when it renders `reasoning_content` back into a later prompt. A block
that is never closed (max_tokens hit) is all reasoning, with no content.
"""

from __future__ import annotations

from areno.tools.base import partial_tag_len

THINK_START = "<think>"
THINK_END = "</think>"
_SEPARATOR = "\n"


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open reasoning block, so the reply starts in it."""
    return prompt_text.rstrip().endswith(THINK_START)


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole reply that began inside a reasoning block; either is ""
    when absent. Runs the streaming splitter over the text, so whole and streamed always agree."""
    stream = ReasoningStream()
    reasoning, content = stream.feed(text)
    return reasoning + stream.finish(), content


class ReasoningStream:
    """Splits one reply that began inside a reasoning block, delta by delta.

    Until the end tag is seen, text is reasoning; text that may be the start of a split end tag
    (`</thi` + `nk>`) or trailing newlines (which may turn out to precede it) are held back until
    decided. After the tag, every delta is content.
    """

    def __init__(self) -> None:
        self._held = ""
        self._in_reasoning = True
        self._emitted_reasoning = False
        self._emitted_content = False

    def feed(self, delta_text: str) -> tuple[str, str]:
        """(reasoning, content) decided by the next piece of generated text."""
        if not self._in_reasoning:
            return "", self._content(delta_text)
        self._held += delta_text
        end = self._held.find(THINK_END)
        if end >= 0:
            reasoning, rest = self._held[:end], self._held[end + len(THINK_END) :]
            self._held, self._in_reasoning = "", False
            return self._reasoning(reasoning.rstrip(_SEPARATOR)), self._content(rest)
        keep = partial_tag_len(self._held, THINK_END)
        decided = self._held[: len(self._held) - keep]
        emit = decided.rstrip(_SEPARATOR)
        self._held = self._held[len(emit) :]
        return self._reasoning(emit), ""

    def finish(self) -> str:
        """The reasoning still held once generation has ended inside the block (a partial end
        tag is reasoning text then; trailing newlines are not)."""
        held, self._held = self._held, ""
        return self._reasoning(held.rstrip(_SEPARATOR)) if self._in_reasoning else ""

    def _reasoning(self, text: str) -> str:
        if not self._emitted_reasoning:
            text = text.lstrip(_SEPARATOR)
        self._emitted_reasoning = self._emitted_reasoning or bool(text)
        return text

    def _content(self, text: str) -> str:
        if not self._emitted_content:
            text = text.lstrip(_SEPARATOR)
        self._emitted_content = self._emitted_content or bool(text)
        return text
