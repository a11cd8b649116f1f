"""SamplingParams: validation messages and normalisation."""

from __future__ import annotations

import pytest

from areno.engine.sampling import SamplingParams
from areno.errors import ArenoError, ConfigError

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"temperature": -0.1},
            r"temperature must be a finite number >= 0 \(0 = greedy\); got -0.1",
        ),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\] \(1 = off\); got 0.0"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -2}, r"top_k must be -1 or 0 \(off\) or an integer >= 1; got -2"),
        ({"top_k": 2.5}, "top_k must be"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\] \(0 = off\); got 1.1"),
        ({"seed": 2**64}, "seed must be None or an integer in"),
        ({"seed": "7"}, "seed must be None or an integer"),
        ({"max_tokens": 0}, "max_tokens must be None or an integer >= 1; got 0"),
        ({"n": 0}, "n must be an integer >= 1; got 0"),
        ({"n": True}, "n must be an integer"),
        ({"stop": ("ok", "")}, "stop must hold non-empty strings"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids must hold integers >= 0"),
        ({"top_logprobs": 21, "logprobs": True}, r"top_logprobs must be an integer in \[0, 20\]"),
        ({"top_logprobs": 3}, "top_logprobs = 3 requires logprobs=True"),
    ],
)
def test_invalid_values_are_named_in_the_message(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        SamplingParams(**fields)
    assert isinstance(info.value, ArenoError)
    assert info.value.param == next(iter(fields))


def test_defaults_and_normalisation() -> None:
    params = SamplingParams(top_k=0, stop=["a", "b"], stop_token_ids=[1, 2])
    assert params.top_k == -1 and params.stop == ("a", "b") and params.stop_token_ids == (1, 2)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.n == 1
    assert not params.is_greedy and SamplingParams(temperature=0).is_greedy
    assert hash(params) == hash(SamplingParams(top_k=-1, stop=("a", "b"), stop_token_ids=(1, 2)))
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # type: ignore[misc]
