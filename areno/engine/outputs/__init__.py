"""What the engine hands back: per-step deltas of each request's samples, and scored tokens."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class EngineDeadError(RuntimeError):
    """The engine thread hit an internal error or was shut down; requests cannot proceed. Here
    rather than beside the Generator, so the serving layer can tell it without importing the
    engine (torch's compiler and the model code: seconds of every replica's start)."""


class AbortCause(enum.StrEnum):
    """Why a request ended with finish_reason "abort": who cut it off. Callers tell their own
    aborts (nothing to report) from the engine's (the request was cut off: report it)."""

    CALLER = "caller"  # its caller called `Generator.abort(request_id)` or left its stream
    PAUSE = "pause"  # `Generator.pause(mode="abort")` (e.g. before a weight update)
    SHUTDOWN = "shutdown"  # `Generator.shutdown()`
    ENGINE_ERROR = "engine_error"  # a step failed (its callers got EngineDeadError first)


@dataclass
class SampleDelta:
    """What one sample (0 <= index < n) produced in one step.

    token_ids are exactly the sampled tokens (token-in, token-out); text is the newly final text,
    which may lag the tokens (an incomplete UTF-8 character, or a possible stop-string prefix is
    held back) and never contains a matched stop string unless `include_stop_str_in_output`.
    logprobs are raw-logit log-probabilities of token_ids (None unless requested); top_logprobs
    has one list of (token_id, logprob) per token.
    """

    index: int
    token_ids: list[int]
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    abort_cause: AbortCause | None = None  # with finish_reason "abort": why
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    # the policy version that produced each token (set by `merge_outputs`)
    policy_versions: list[int] | None = None


@dataclass(frozen=True)
class RequestTimings:
    """Where a finished request's time went inside the engine, in seconds on the engine's clock
    (the Server-Timing header and the serve timeline benchmark read them): waiting to be
    admitted, admitted until its first token reached the host (prefill, and a step of decode
    with overlapped steps), and from then until it finished."""

    queue_s: float
    prefill_s: float
    decode_s: float


@dataclass
class TokenScores:
    """What `Generator.score` returns for a sequence of N tokens.

    logprobs: the raw-logit log-probability of each of tokens 1..N-1 given the tokens before it
    (N-1 entries; the first token has none). top_logprobs (when asked for): at each of those
    positions the most likely tokens as (token_id, logprob), most likely first, as
    `SampleDelta.top_logprobs` holds them.
    """

    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class RequestOutput:
    """One step's news for one request; `finished` once all its samples are."""

    request_id: str
    samples: list[SampleDelta] = field(default_factory=list)
    num_prompt_tokens: int = 0
    policy_version: int = 0
    finished: bool = False
    # The request's prompt tokens prefilled so far and, of them, those the prefix cache held
    # (`SequenceGroup.num_prefill_tokens`): counted once for a request's samples.
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None  # once finished


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Fold a request's stream of deltas into one output with one delta per sample; each token
    keeps the policy version that produced it (a delta's own, or its output's)."""
    if not outputs:
        raise ValueError("no outputs to merge")
    merged: dict[int, SampleDelta] = {}
    for output in outputs:
        for delta in output.samples:
            total = merged.setdefault(delta.index, SampleDelta(delta.index, []))
            total.token_ids += delta.token_ids
            versions = delta.policy_versions or [output.policy_version] * len(delta.token_ids)
            total.policy_versions = (total.policy_versions or []) + versions
            total.text += delta.text
            if delta.logprobs is not None:
                total.logprobs = (total.logprobs or []) + delta.logprobs
            if delta.top_logprobs is not None:
                total.top_logprobs = (total.top_logprobs or []) + delta.top_logprobs
            total.finish_reason = delta.finish_reason or total.finish_reason
            total.abort_cause = delta.abort_cause or total.abort_cause
            total.stop_reason = delta.stop_reason or total.stop_reason
    last = outputs[-1]
    return RequestOutput(
        last.request_id,
        [merged[i] for i in sorted(merged)],
        last.num_prompt_tokens,
        last.policy_version,
        last.finished,
        last.num_prefill_tokens,
        last.num_cached_tokens,
        last.timings,
    )
