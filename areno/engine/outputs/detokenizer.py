"""Incremental detokenization: generated token ids to streamed text at O(1) cost per token.

Decoding the whole output after every token costs O(n) per step. Instead a short window of ids is
decoded twice (the prefix-offset / read-offset technique used by TGI and vLLM):

    window = ids[prefix:]          text of ids[prefix:read] is already final
    new    = decode(window)[len(decode(window[:read - prefix])):]

`new` becomes final unless the window's text ends in U+FFFD (an incomplete UTF-8 sequence that a
later token may finish); then `prefix, read = read, len(ids)`. Both decodes start at the same
token, so whatever a decoder does at the start of a decode (SentencePiece drops a leading space)
cancels out; the window is seeded with the prompt's last tokens so the first output token is
rendered as in context.

Two tokenizer behaviours need more than the textbook scheme to match `tokenizer.decode`:

- Byte fallback (`<0xNN>` tokens, Gemma): the ByteFallback decoder turns a run of byte tokens into
  its UTF-8 text only if the whole run is valid, and into one U+FFFD per byte otherwise, so a
  valid "你" becomes "\ufffd" x 4 once a stray byte follows it. Text is therefore held while the
  window ends in a byte token, without decoding, and decoded once when the run ends.
- Special tokens: with `skip_special_tokens=True` the backend drops every added token flagged
  special (a wider set than `all_special_ids`) before decoding, so they are never put in the
  window. Without skipping, an added token splits the decode into separately decoded segments;
  the window decodes the same segments, so nothing special is needed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Enough context for any decoder's start-of-decode effects (vLLM and TGI use 5 as well).
NUM_SEED_TOKENS = 5


@dataclass(frozen=True)
class _TokenClasses:
    """The ids a detokenizer treats specially, computed once per tokenizer."""

    special_ids: frozenset[int]
    byte_ids: frozenset[int]


# Building _TokenClasses costs ~1.5 ms (256 vocab look-ups); detokenizers are made per sequence.
_TOKEN_CLASSES: weakref.WeakKeyDictionary[Any, _TokenClasses] = weakref.WeakKeyDictionary()


def _special_ids(tokenizer: Any) -> frozenset[int]:
    # NOTE: the Rust backend skips added tokens flagged special, which include some that
    # `all_special_ids` lacks (Gemma 4's `<|turn>`); take both so either backend is covered.
    added = getattr(tokenizer, "added_tokens_decoder", {})
    flagged = {token_id for token_id, token in added.items() if token.special}
    return frozenset(tokenizer.all_special_ids) | flagged


def _byte_fallback_ids(tokenizer: Any) -> frozenset[int]:
    names = {f"<0x{byte:02X}>" for byte in range(256)}
    ids = [i for i in tokenizer.convert_tokens_to_ids(sorted(names)) if i is not None]
    # Unknown names map to None or to the unk id; keep only ids whose token really is the name.
    tokens = tokenizer.convert_ids_to_tokens(ids)
    return frozenset(i for i, token in zip(ids, tokens, strict=True) if token in names)


def _token_classes(tokenizer: Any) -> _TokenClasses:
    try:
        return _TOKEN_CLASSES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: compute each time
        return _TokenClasses(_special_ids(tokenizer), _byte_fallback_ids(tokenizer))
    classes = _TokenClasses(_special_ids(tokenizer), _byte_fallback_ids(tokenizer))
    _TOKEN_CLASSES[tokenizer] = classes
    return classes


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, one token at a time, for streaming.

    The concatenation of all `add()` returns plus `flush()` equals
    `tokenizer.decode(output_ids, skip_special_tokens=...)`, except that the first output token
    keeps a leading space that a SentencePiece decoder would drop at the start of a decode.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        classes = _token_classes(tokenizer)
        self._skipped_ids = classes.special_ids if skip_special_tokens else frozenset()
        self._byte_ids = classes.byte_ids
        # NOTE: the window holds ids[prefix:]; `_read` indexes into it, and the text of
        # window[:_read] is final and ends on a character boundary.
        self._window = self._seed(prompt_token_ids)
        self._read = len(self._window)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All final text so far: the concatenation of everything `add()` and `flush()` returned."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text that became final by it ("" if none)."""
        if token_id in self._skipped_ids:
            return ""
        self._window.append(token_id)
        if token_id in self._byte_ids:
            return ""  # a byte-fallback run decodes all or nothing; wait for its end
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._finalize(window_text[len(prefix_text) :])

    def decode_rest(self, token_ids: list[int]) -> str:
        """What `add` of each of `token_ids` and then `flush` return, joined, from one decode:
        for a caller that reads no text before the sequence ends."""
        for token_id in token_ids:
            if token_id not in self._skipped_ids:
                self._window.append(token_id)
        return self.flush()

    def flush(self) -> str:
        """At the end of the sequence, return the text held back (U+FFFD for incomplete bytes)."""
        prefix_text, window_text = self._decode_window()
        return self._finalize(window_text[len(prefix_text) :])

    def _seed(self, prompt_token_ids: list[int]) -> list[int]:
        """The last few prompt tokens, as context that the output's first token decodes after."""
        seed: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if len(seed) == NUM_SEED_TOKENS:
                break
            if token_id not in self._skipped_ids:
                seed.append(token_id)
        seed.reverse()
        # A trailing byte run would merge with one the output starts with, changing both texts.
        while seed and seed[-1] in self._byte_ids:
            seed.pop()
        # A seed ending mid-character would swallow the output's first bytes; go without one.
        if seed and self._decode(seed).endswith(REPLACEMENT_CHAR):
            return []
        return seed

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_window(self) -> tuple[str, str]:
        return self._decode(self._window[: self._read]), self._decode(self._window)

    def _finalize(self, new_text: str) -> str:
        """Make `new_text` final and slide the window: the old read offset becomes the prefix."""
        del self._window[: self._read]
        self._read = len(self._window)
        if new_text:
            self._chunks.append(new_text)
        return new_text
