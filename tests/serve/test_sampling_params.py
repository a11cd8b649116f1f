"""Reading a Chat Completions or Completions request's sampling fields (`areno.serve.sampling`)."""

from __future__ import annotations

from areno.engine.sampling import SamplingParams
from areno.protocol import parse_chat_request, parse_completion_request
from areno.serve.sampling import completion_sampling_params, sampling_params

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_request_reads_every_sampling_field() -> None:
    request = parse_chat_request(
        {
            "messages": MESSAGES,
            "temperature": 0.3,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 11,
            "max_tokens": 100,
            "max_completion_tokens": 50,
            "stop": ["</s>", "END"],
            "stop_token_ids": [7],
            "ignore_eos": True,
            "n": 3,
            "logprobs": True,
            "top_logprobs": 5,
        }
    )
    assert sampling_params(request) == SamplingParams(
        temperature=0.3,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=11,
        max_tokens=50,  # max_completion_tokens wins over the legacy max_tokens
        stop=("</s>", "END"),
        stop_token_ids=(7,),
        ignore_eos=True,
        n=3,
        logprobs=True,
        top_logprobs=5,
    )


def test_a_request_fills_defaults_for_unset_and_null_fields() -> None:
    request = parse_chat_request(
        {"messages": MESSAGES, "temperature": None, "top_p": None, "stop": "x", "n": None}
    )
    assert sampling_params(request) == SamplingParams(stop=("x",))
    minimal = sampling_params(parse_chat_request({"messages": MESSAGES}))
    assert minimal == SamplingParams()


def test_a_request_greedy_and_disabled_top_k() -> None:
    request = parse_chat_request({"messages": MESSAGES, "temperature": 0, "top_k": -1})
    params = sampling_params(request)
    assert params.is_greedy and params.top_k == -1


def test_a_completion_request_reads_the_same_fields_and_its_own_limits() -> None:
    shared = {"temperature": 0.3, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 11}
    shared |= {"stop": ["END"], "stop_token_ids": [7], "ignore_eos": True, "n": 3}
    chat = sampling_params(parse_chat_request({"messages": MESSAGES, **shared, "max_tokens": 9}))
    request = parse_completion_request({"prompt": "hi", **shared, "max_tokens": 9, "logprobs": 2})
    assert completion_sampling_params(request) == SamplingParams(
        **{**chat.__dict__, "logprobs": True, "top_logprobs": 2}
    )
    assert chat.logprobs is False


def test_a_completion_request_defaults_and_its_scoring_form() -> None:
    default = completion_sampling_params(parse_completion_request({"prompt": [1, 2]}))
    assert default == SamplingParams(max_tokens=16)  # OpenAI's default limit
    logprobs_0 = parse_completion_request({"prompt": "hi", "logprobs": 0})
    assert completion_sampling_params(logprobs_0) == SamplingParams(max_tokens=16, logprobs=True)
    # max_tokens 0 with echo generates nothing: the prompt is only scored.
    score_only = parse_completion_request({"prompt": "hi", "max_tokens": 0, "echo": True})
    assert completion_sampling_params(score_only) is None
