"""When a sequence stops: stop tokens, stop strings and its length limits (OpenAI semantics)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from areno.engine.sequence import Sequence


@dataclass(frozen=True)
class StopCheck:
    """Why a sequence stops after its newest token.

    reason: "stop" or "length".
    stop_str: the stop string matched, if any.
    stop_str_start: where it starts in the `detokenized_tail` given to `check_stop`.
    text_end: where the output text should end in that tail: the stop string's start, or its end
        with `include_stop_str_in_output`. None when no stop string matched.
    """

    reason: str
    stop_str: str | None = None
    stop_str_start: int | None = None
    text_end: int | None = None


def check_stop(
    seq: Sequence,
    new_token_id: int,
    eos_token_ids: Collection[int],
    detokenized_tail: str | None,
    *,
    max_context_len: int,
) -> StopCheck | None:
    """Whether `seq` stops after `new_token_id`, which the caller has already appended.

    Stop reasons win over length ones (OpenAI semantics): EOS (unless `ignore_eos`) and
    `stop_token_ids` first, then stop strings, then `max_tokens`, then `max_context_len`. Stop
    strings end only an output longer than `min_tokens` (the sampler keeps stop tokens from
    being drawn before it).
    `detokenized_tail` is the end of the output text, including the new token's text and at
    least `max(len(s) for s in stop) - 1` characters before it, so a stop string spanning two
    tokens is found; a match earlier in the tail would have stopped an earlier step. Pass None
    when the request has no stop strings (detokenization stays with the caller).
    """
    assert seq.last_token_id == new_token_id and seq.output_token_ids, "append the token first"
    params = seq.params
    if new_token_id in params.stop_token_ids or (
        not params.ignore_eos and new_token_id in eos_token_ids
    ):
        return StopCheck("stop")
    if params.stop and detokenized_tail and seq.num_output_tokens >= params.min_tokens:
        found = _find_stop_string(params.stop, detokenized_tail)
        if found is not None:
            start, stop_str = found
            end = start + len(stop_str) if params.include_stop_str_in_output else start
            return StopCheck("stop", stop_str, start, end)
    if reaches_length_limit(seq, max_context_len):
        return StopCheck("length")
    return None


def reaches_length_limit(seq: Sequence, max_context_len: int, ahead: int = 0) -> bool:
    """Whether `seq`, with `ahead` more tokens than it has read, is at max_tokens or fills the
    context: its last token then is its final one."""
    max_tokens = seq.params.max_tokens
    if max_tokens is not None and seq.num_output_tokens + ahead >= max_tokens:
        return True
    return seq.num_tokens + ahead >= max_context_len


def _find_stop_string(stops: tuple[str, ...], text: str) -> tuple[int, str] | None:
    """The earliest stop string in `text` (the longest one on a tie), as (start, string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        if best is None or start < best[0] or (start == best[0] and len(stop) > len(best[1])):
            best = (start, stop)
    return best
