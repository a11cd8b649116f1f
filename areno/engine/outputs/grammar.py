"""Structured outputs: each grammar-bound sequence's token mask, from xgrammar.

`Grammars` compiles a request's `StructuredOutput` once per distinct spec (an LRU of compiled
grammars: an agent sends the same schema or tools request after request) and gives each
sequence its own matcher. Per step, the engine core asks every grammar row's matcher for the
tokens it allows next (`fill`), a packed bitmask the sampler applies on the device
(`areno/engine/sample/sampler.py`), then advances the matcher with the token drawn (`accept`).

NOTE: a matcher must see a row's token before it can mask that row's next one, so a step with
grammar rows is never launched ahead of the previous step's tokens (`EngineCore.step`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from areno.engine.sampling import StructuredOutput
from areno.errors import ConfigError

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

# Compiled grammars kept (a compiled JSON schema over a 150k vocabulary is a few MB at most).
MAX_CACHED_GRAMMARS = 256


class GrammarError(ConfigError):
    """A structured-output spec that does not compile; `param` names the request field."""


class Grammars:
    """Compiles specs against one tokenizer and vocabulary size (the model's logits width,
    which may exceed the tokenizer's), ending in the engine's EOS tokens."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int]):
        import xgrammar  # here, not at import: an engine that never meets a grammar skips it

        stops = set(stop_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            stops.add(tokenizer.eos_token_id)
        if not stops:
            raise GrammarError(
                "structured outputs need an end-of-sequence token, and neither the model's "
                "generation config nor its tokenizer names one",
                param="structured",
            )
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stops)
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self._compiled: OrderedDict[StructuredOutput, xgrammar.CompiledGrammar] = OrderedDict()
        # Requests are checked (compiled) on the caller's thread, matchers made on the engine's.
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec` (cached); GrammarError when it does not compile."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's own errors
            raise GrammarError(
                f"{spec.param}: the {spec.kind.replace('_', ' ')} cannot be compiled into a "
                f"grammar: {error}",
                param=spec.param,
            ) from error
        with self._lock:
            self._compiled[spec] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        # No free whitespace: a model could otherwise pad the object until max_tokens.
        if spec.kind == "json_object":  # any object (not any JSON value), any properties
            return self._compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if spec.kind == "json_schema":
            return self._compiler.compile_json_schema(spec.spec, any_whitespace=False)
        return self._compiler.compile_structural_tag(spec.spec)

    def matcher(self, spec: StructuredOutput) -> xgrammar.GrammarMatcher:
        """A fresh matcher for one sequence of a request with `spec`."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec))

    def bitmask(self, num_rows: int) -> torch.Tensor:
        """A (rows, ceil(vocab / 32)) int32 mask allowing every token (-1: all bits set)."""
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill(matcher: xgrammar.GrammarMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Write the tokens `matcher` allows next into `bitmask[row]`."""
    matcher.fill_next_token_bitmask(bitmask, row)


def accept(matcher: xgrammar.GrammarMatcher, token_id: int) -> bool:
    """Advance `matcher` by a drawn token; False when the grammar does not allow it (the mask
    forbade it, so only a stop token past the grammar's end, with ignore_eos, gets here)."""
    if matcher.is_terminated():
        return False
    accepted = matcher.accept_token(token_id)
    if not accepted:
        logger.warning("grammar refused token %d although the mask allowed it", token_id)
    return accepted


def allowed_tokens(bitmask_BW: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The packed bitmask as a (rows, vocab) bool tensor (bit j of word w: token 32 w + j), on
    the bitmask's device."""
    shifts_32 = torch.arange(32, device=bitmask_BW.device, dtype=torch.int32)
    bits_BW32 = (bitmask_BW[:, :, None] >> shifts_32) & 1
    return bits_BW32.reshape(bitmask_BW.shape[0], -1)[:, :vocab_size].bool()
