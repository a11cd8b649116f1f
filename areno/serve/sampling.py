"""A request's sampling fields as the engine's `SamplingParams`: the HTTP side of the boundary,
so the engine knows no request types. Chat Completions and Completions share every field but
the generation limit and the logprobs ones."""

from __future__ import annotations

from typing import Any

from areno.engine.sampling import SamplingParams
from areno.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from areno.serve.structured import json_output


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _shared_params(request: GenerationRequest, **fields: Any) -> SamplingParams:
    """The fields both requests have, unset ones at their defaults, plus `fields`."""
    return SamplingParams(
        temperature=_given(request.temperature, 1.0),
        top_p=_given(request.top_p, 1.0),
        top_k=_given(request.top_k, -1),
        min_p=_given(request.min_p, 0.0),
        seed=request.seed,
        stop=tuple(request.stop_sequences),
        stop_token_ids=tuple(_given(request.stop_token_ids, ())),
        ignore_eos=request.ignore_eos,
        n=request.n,
        presence_penalty=_given(request.presence_penalty, 0.0),
        frequency_penalty=_given(request.frequency_penalty, 0.0),
        repetition_penalty=_given(request.repetition_penalty, 1.0),
        logit_bias=tuple((request.logit_bias or {}).items()),
        min_tokens=_given(request.min_tokens, 0),
        **fields,
    )


def sampling_params(request: ChatCompletionRequest) -> SamplingParams:
    """The sampling parameters of a Chat Completions request; unset fields take defaults."""
    return _shared_params(
        request,
        max_tokens=request.max_new_tokens,
        logprobs=request.logprobs,
        top_logprobs=_given(request.top_logprobs, 0),
    )


def completion_sampling_params(request: CompletionRequest) -> SamplingParams | None:
    """The sampling parameters of a Completions request; None when it generates nothing
    (`max_tokens` 0 with `echo`: the prompt is only scored). `logprobs` N asks for the
    sampled tokens' logprobs and N alternatives each."""
    if request.max_tokens == 0:
        return None
    return _shared_params(
        request,
        max_tokens=request.max_tokens,
        logprobs=request.logprobs is not None,
        top_logprobs=_given(request.logprobs, 0),
        structured=json_output(request.response_format),
    )
