"""A Chat Completions request's sampling fields as the engine's `SamplingParams`: the HTTP side
of the boundary, so the engine knows no request types."""

from __future__ import annotations

from areno.engine.sampling import SamplingParams
from areno.protocol import ChatCompletionRequest


def sampling_params(request: ChatCompletionRequest) -> SamplingParams:
    """The sampling parameters of a Chat Completions request; unset fields take defaults."""

    def given(value, default):
        return default if value is None else value

    return SamplingParams(
        temperature=given(request.temperature, 1.0),
        top_p=given(request.top_p, 1.0),
        top_k=given(request.top_k, -1),
        min_p=given(request.min_p, 0.0),
        seed=request.seed,
        max_tokens=request.max_new_tokens,
        stop=tuple(request.stop_sequences),
        stop_token_ids=tuple(given(request.stop_token_ids, ())),
        ignore_eos=request.ignore_eos,
        n=request.n,
        logprobs=request.logprobs,
        top_logprobs=given(request.top_logprobs, 0),
        presence_penalty=given(request.presence_penalty, 0.0),
        frequency_penalty=given(request.frequency_penalty, 0.0),
        repetition_penalty=given(request.repetition_penalty, 1.0),
        logit_bias=tuple((request.logit_bias or {}).items()),
        min_tokens=given(request.min_tokens, 0),
    )
