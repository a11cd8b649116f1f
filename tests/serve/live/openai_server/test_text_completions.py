"""`/v1/completions` on the open Gemma 4 app: text, token-id and batched prompts, streaming
against the whole response, echo with prompt logprobs as an evaluation harness scores them, and
what it does not do refused by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from tests.serve.live.apps import PET_SCHEMA
from tests.serve.live.openai_server.client import MAX_PROMPT_TOKENS, complete, completion_log


def test_completions_of_a_text_prompt_and_of_its_token_ids_agree(server, tokenizer):
    text = "Once upon a time"
    by_text = complete(server, text)
    ids = tokenizer(text)["input_ids"]
    by_ids = complete(server, ids)
    for response in (by_text, by_ids):
        assert response.object == "text_completion" and response.id.startswith("cmpl-")
        [choice] = response.choices
        assert choice.index == 0 and choice.finish_reason in {"stop", "length"}
        assert response.usage.prompt_tokens == len(ids)  # no chat template around it
        assert 0 < response.usage.completion_tokens <= 6
    assert by_text.choices[0].text == by_ids.choices[0].text
    record = completion_log(by_text.id)
    assert record["choices"][0]["text"] == by_text.choices[0].text
    assert record["prompt_tokens"] == len(ids)


def test_completions_index_a_batch_of_prompts_times_n(server):
    prompts = ["Red", "Green", "Blue"]
    response = complete(server, prompts, n=2, temperature=1.0, seed=3, max_tokens=3, echo=True)
    assert [c.index for c in response.choices] == list(range(6))
    for choice in response.choices:  # choice i * n + j is sample j of prompt i
        assert choice.text.startswith(prompts[choice.index // 2])
    assert response.usage.completion_tokens > 0


def test_completions_stream_with_usage_matches_the_full_response(server):
    prompt = ["The quick brown fox", "jumps over"]
    full = complete(server, prompt, max_tokens=8)
    stream = complete(
        server, prompt, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        assert chunk.object == "text_completion"
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


@pytest.fixture(scope="module")
def base_model(tiny_path):
    from areno.models.registry import adapter_for_checkpoint

    path = tiny_path("gemma4")
    return adapter_for_checkpoint(path).load_model(path).eval()


def test_echo_scores_the_prompt_as_the_model_does(server, tokenizer, base_model):
    """lm-eval's `local-completions` loglikelihood request: token-id prompts, echo, top-2
    alternatives, nothing generated. Each prompt token's logprob (the first has none) and
    alternatives are those of a transformers forward over the same tokens."""
    prompts = [tokenizer(t)["input_ids"] for t in ("The cat sat on the mat.", "Hello")]
    response = complete(server, prompts, echo=True, logprobs=2, max_tokens=0)
    assert response.usage.completion_tokens == 0
    for ids, choice in zip(prompts, response.choices, strict=True):
        assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs.tokens == [tokenizer.decode([t]) for t in ids]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        with torch.no_grad():
            logits = base_model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        expected_NV = torch.log_softmax(logits, -1)
        expected = expected_NV.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        torch.testing.assert_close(
            torch.tensor(logprobs.token_logprobs[1:]), expected, atol=1e-3, rtol=1e-3
        )
        top_lps, top_ids = expected_NV.topk(2)
        for top, want_ids, want_lps in zip(
            logprobs.top_logprobs[1:], top_ids, top_lps, strict=True
        ):
            assert list(top) == [tokenizer.decode([t]) for t in want_ids.tolist()]
            torch.testing.assert_close(
                torch.tensor(list(top.values())), want_lps, atol=1e-3, rtol=1e-3
            )


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"suffix": "!"}, "suffix"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"best_of": 2}, "best_of"),
        ({"extra_body": {"min_tokens": 9}}, "min_tokens"),  # over max_tokens
        ({"extra_body": {"response_format": {"type": "json_schema"}}}, "response_format"),
        ({"extra_body": {"max_new_tokens": 2}}, "max_new_tokens"),  # unknown
        ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_completions_refuse_what_they_do_not_do_by_name(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(server, "Hi", **kwargs)
    assert caught.value.param == param and param in caught.value.message


def test_completions_honour_logit_bias_and_response_format(server, tokenizer):
    token_id = tokenizer.encode("a", add_special_tokens=False)[0]
    biased = complete(server, "Hi", logit_bias={str(token_id): 100}, temperature=1.0, seed=3)
    assert biased.choices[0].text == tokenizer.decode([token_id]) * 6
    format_ = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    shaped = complete(server, "A pet:", max_tokens=48, extra_body={"response_format": format_})
    jsonschema.validate(json.loads(shaped.choices[0].text), PET_SCHEMA)


def test_completions_refuse_bad_prompts_and_keep_serving(server):
    cases = [
        ("word " * (MAX_PROMPT_TOKENS * 2), "prompt", "--max-prompt-tokens"),
        ([[1, 2], [3, 10**7]], "prompt[1][1]", "not in the vocabulary"),
        ([], "prompt", "must not be empty"),
    ]
    for prompt, param, needle in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            complete(server, prompt)
        assert caught.value.param == param and needle in caught.value.message
    with pytest.raises(openai.NotFoundError):
        complete(server, "Hi", model="other-model")
    assert complete(server, "Still there?").choices[0].text is not None
