"""What a sequence's sampled tokens become: its text (detokenized as it grows, stop strings held
back), its stops (stop tokens and strings, limits, a grammar's end) and, under a grammar, the
mask of its next token. `EngineCore` hands each step's tokens to the `OutputProcessor` and
builds the request outputs from the deltas it returns; the scheduler and the workers never see
text.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from areno.engine.outputs import SampleDelta
from areno.engine.outputs.detokenizer import IncrementalDetokenizer
from areno.engine.outputs.grammar import Grammars, accept, fill
from areno.engine.outputs.stopping import StopCheck, check_stop
from areno.engine.sampling import SamplingParams
from areno.engine.sequence import Sequence
from areno.engine.step import StepInput


class OutputText:
    """One sequence's output text: detokenized incrementally, released as it becomes final.

    With stop strings, the last `max(len(stop)) - 1` characters are held back until the next
    token shows they do not begin a stop string, so a stop string never leaks into a stream.

    Not `incremental` (a caller that reads the text only at the end, and no stop strings to
    match): the tokens are kept and decoded once when the sequence ends (`rest`), sparing the
    engine thread two decodes a token.
    """

    def __init__(self, tokenizer: Any, seq: Sequence, incremental: bool = True):
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, seq.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens
        )
        self.hold = max((len(s) for s in seq.params.stop), default=1) - 1
        self.has_stops = bool(seq.params.stop)
        self.incremental = incremental or self.has_stops
        self.num_sent = 0
        self._tail_start = 0
        self._kept: list[int] = []

    def add(self, token_id: int) -> str | None:
        """Detokenize a new token; return the text tail `check_stop` needs (None: no stops)."""
        if not self.incremental:
            self._kept.append(token_id)
            return None
        new_text = self.detokenizer.add(token_id)
        if not self.has_stops:
            return None
        text = self.detokenizer.text
        self._tail_start = max(0, len(text) - len(new_text) - self.hold)
        return text[self._tail_start :]

    def rest(self) -> str:
        """Not incremental: the text of the tokens kept so far, which only the sequence's last
        output carries (at an abort, an incomplete last character reads as U+FFFD)."""
        kept, self._kept = self._kept, []
        return self.detokenizer.decode_rest(kept)

    def release(self, stop: StopCheck | None, finished: bool) -> str:
        """The text that became final with this step's token."""
        if not self.incremental:
            return self.rest() if finished else ""
        if stop is not None and stop.text_end is not None:
            end = self._tail_start + stop.text_end
            text = self.detokenizer.text
        elif finished:
            self.detokenizer.flush()
            text = self.detokenizer.text
            end = len(text)
        else:
            text = self.detokenizer.text
            end = len(text) - self.hold
        delta = text[self.num_sent : end] if end > self.num_sent else ""
        self.num_sent = max(self.num_sent, end)
        return delta


class OutputProcessor:
    """Every running sequence's `OutputText` and grammar matcher; see the module docstring.

    `vocab_size` is read when the first grammar is compiled (the logits' width, which may
    exceed the tokenizer's)."""

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: Collection[int],
        vocab_size: Callable[[], int],
        max_context_len: int,
    ):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context_len = max_context_len
        self._vocab_size = vocab_size
        self._grammars: Grammars | None = None  # built on the first structured request
        self._texts: dict[int, OutputText] = {}
        self._matchers: dict[int, Any] = {}  # seq_id -> its xgrammar matcher

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler over the tokenizer, the vocabulary and the EOS tokens."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self._vocab_size(), self.eos_token_ids)
        return self._grammars

    @property
    def has_grammars(self) -> bool:
        """Whether a running sequence follows a grammar (its steps cannot be overlapped)."""
        return bool(self._matchers)

    def check(self, params: SamplingParams) -> None:
        """Raise GrammarError for a grammar that does not compile (then cached for `add`)."""
        if params.structured is not None:
            self.grammars.compile(params.structured)

    def add(self, seqs: list[Sequence], params: SamplingParams, *, stream: bool) -> None:
        """Track new sequences: a matcher each under a grammar, a text each when detokenized
        (`stream` False: decoded once at the end, `OutputText`)."""
        for seq in seqs:
            if params.structured is not None:
                self._matchers[seq.seq_id] = self.grammars.matcher(params.structured)
            if params.detokenize:
                self._texts[seq.seq_id] = OutputText(self.tokenizer, seq, incremental=stream)

    def mask_grammar_rows(self, step: StepInput, seqs: list[Sequence]) -> None:
        """Each grammar row's allowed next tokens, from its matcher (`seqs` in row order)."""
        rows = [
            (i, self._matchers[s.seq_id]) for i, s in enumerate(seqs) if s.seq_id in self._matchers
        ]
        if not rows:
            return
        step.token_bitmask = self.grammars.bitmask(len(seqs))
        for i, matcher in rows:
            fill(matcher, step.token_bitmask, i)
        step.grammar_rows = [i for i, _ in rows]

    def append(
        self, seq: Sequence, token_id: int, logprob: float, top_logprobs: Any
    ) -> SampleDelta:
        """`seq`'s new token: appended, checked for stops (the sequence finishes on one), and
        the delta of its output."""
        seq.append_token(token_id)
        text = self._texts.get(seq.seq_id)
        tail = None
        if text is not None and not self._is_stop_token(seq, token_id):
            tail = text.add(token_id)
        stop = check_stop(
            seq, token_id, self.eos_token_ids, tail, max_context_len=self.max_context_len
        )
        matcher = self._matchers.get(seq.seq_id)
        if matcher is not None and (not accept(matcher, token_id) or matcher.is_terminated()):
            stop = stop or StopCheck("stop")  # the grammar is complete (or, ignore_eos, past it)
        if stop is not None:
            seq.finish(stop.reason)
        params = seq.params
        return SampleDelta(
            index=seq.sample_index,
            token_ids=[token_id],
            text=text.release(stop, stop is not None) if text is not None else "",
            logprobs=[logprob] if params.logprobs else None,
            top_logprobs=[top_logprobs] if params.top_logprobs else None,
            finish_reason=stop.reason if stop is not None else None,
            stop_reason=_stop_reason(stop, token_id, params),
        )

    def kept_text(self, seq: Sequence) -> str:
        """The text a non-incremental sequence kept back (`OutputText.rest`); "" otherwise."""
        text = self._texts.get(seq.seq_id)
        return text.rest() if text is not None and not text.incremental else ""

    def forget(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._texts.pop(seq.seq_id, None)
            self._matchers.pop(seq.seq_id, None)

    def _is_stop_token(self, seq: Sequence, token_id: int) -> bool:
        params = seq.params
        return token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        )


def _stop_reason(stop: StopCheck | None, token_id: int, params: SamplingParams) -> str | int | None:
    if stop is None or stop.reason != "stop":
        return None
    if stop.stop_str is not None:
        return stop.stop_str
    return token_id if token_id in params.stop_token_ids else None
