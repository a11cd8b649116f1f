"""Reading a Chat Completions request's sampling fields (`areno.serve.sampling`)."""

from __future__ import annotations

from areno.engine.sampling import SamplingParams
from areno.protocol import parse_chat_request
from areno.serve.sampling import sampling_params

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
