"""Sampling fields and output formats on the open Gemma 4 app: a json_schema reply that validates,
logit_bias and frequency_penalty with visible effects, and fields that would be silently ignored
refused by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serve.live.apps import PET_SCHEMA
from tests.serve.live.openai_server.client import ask


def test_a_json_schema_reply_validates_against_the_schema(server):
    """Random weights: only the grammar makes these replies parse."""

    format_ = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    response = ask(server, "Name a pet.", response_format=format_, n=2, temperature=1.0, seed=2,
                   max_tokens=48)  # fmt: skip
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)
        assert choice.finish_reason == "stop"


def test_logit_bias_of_100_makes_every_token_that_token(server, tokenizer):
    token_id = tokenizer.encode("a", add_special_tokens=False)[0]
    response = ask(server, "Hello.", logit_bias={str(token_id): 100}, temperature=1.0, seed=1,
                   max_tokens=6, logprobs=True)  # fmt: skip
    tokens = [t.token for t in response.choices[0].logprobs.content]
    assert tokens == [tokenizer.decode([token_id])] * 6
    # Logprobs stay the model's own: the bias does not make the token certain.
    assert all(t.logprob < 0 for t in response.choices[0].logprobs.content)


def test_a_frequency_penalty_removes_repeats_from_a_greedy_reply(server):
    def tokens(**kwargs):
        """The reply's tokens as text, less the byte tokens of partial characters (each
        decodes to U+FFFD alone, so distinct ids would compare equal)."""
        response = ask(server, "Tell me a story.", max_tokens=40, logprobs=True,
                       extra_body={"ignore_eos": True}, **kwargs)  # fmt: skip
        return [t.token for t in response.choices[0].logprobs.content if t.token != "\ufffd"]

    greedy = tokens()
    penalised = tokens(frequency_penalty=2.0)
    assert len(set(greedy)) < len(greedy), "the plain greedy reply repeats itself"
    assert len(set(penalised)) == len(penalised)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("store", True),
        ("reasoning_effort", "high"),
        ("functions", [{"name": "f"}]),
        ("no_such_field", 1),
        ("logit_bias", {"x": 1}),
    ],
)
def test_fields_that_would_be_ignored_are_refused_by_name(server, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server, "Hi.", extra_body={field: value})
    assert caught.value.body["param"] == field and field in caught.value.message
    assert ask(server, "Hi.").choices[0].finish_reason in {"stop", "length"}


def test_return_token_ids_gives_the_engines_ids_whole_and_streamed(server, media, tokenizer):
    """`return_token_ids` (vLLM's field): the prompt as the engine ran it, the image's
    placeholders expanded (as many ids as usage counts), and each choice's sampled ids, equal
    whole and streamed (the first chunk carries the prompt's, every chunk its tokens'); the
    completions route gives each choice its prompt's ids (a token-id prompt's as sent), whole
    and streamed (on the choice's first chunk). Without the field none of them is there."""
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": media["image"]}},
        {"type": "text", "text": "What is this?"}]}]  # fmt: skip
    common = {"model": "tiny-gemma4", "messages": messages, "max_tokens": 6, "temperature": 0}
    ids = {"return_token_ids": True}
    whole = server.chat.completions.create(**common, extra_body=ids).model_dump()
    prompt, sampled = whole["prompt_token_ids"], whole["choices"][0]["token_ids"]
    assert len(prompt) == whole["usage"]["prompt_tokens"] > 40  # the image's tokens included
    assert len(sampled) == whole["usage"]["completion_tokens"] > 0
    assert tokenizer.decode(sampled, skip_special_tokens=True).startswith(
        whole["choices"][0]["message"]["content"] or ""
    )
    chunks = [c.model_dump() for c in server.chat.completions.create(
        **common, stream=True, extra_body=ids)]  # fmt: skip
    assert chunks[0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in c or c["prompt_token_ids"] is None for c in chunks[1:])
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    assert streamed == sampled
    plain = server.chat.completions.create(**common).model_dump()
    assert plain.get("prompt_token_ids") is None and plain["choices"][0].get("token_ids") is None
    text = server.completions.create(
        model="tiny-gemma4",
        prompt=[prompt[:12], prompt[:8]],
        max_tokens=3,
        temperature=0,
        extra_body={**ids, "ignore_eos": True},
    ).model_dump()
    first, second = sorted(text["choices"], key=lambda c: c["index"])
    assert first["prompt_token_ids"] == prompt[:12] and second["prompt_token_ids"] == prompt[:8]
    assert len(first["token_ids"]) == len(second["token_ids"]) == 3
    text_chunks = [c.model_dump() for c in server.completions.create(
        model="tiny-gemma4", prompt=[prompt[:12], prompt[:8]], max_tokens=3, temperature=0,
        stream=True, extra_body={**ids, "ignore_eos": True})]  # fmt: skip
    for whole_choice in (first, second):
        pieces = [c for chunk in text_chunks for c in chunk["choices"]
                  if c["index"] == whole_choice["index"]]  # fmt: skip
        assert pieces[0]["prompt_token_ids"] == whole_choice["prompt_token_ids"]
        assert all(p.get("prompt_token_ids") is None for p in pieces[1:])
        assert [t for p in pieces for t in p["token_ids"] or []] == whole_choice["token_ids"]


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(server):
    """`usage.prompt_tokens_details.cached_tokens` (chat, streamed usage, completions) and the
    Responses API's `input_tokens_details.cached_tokens`: a long text prompt sent again finds
    its blocks cached; sent the first time, none (and the details are left out)."""
    text = "Tell me about the river that runs to the sea, and why it never stops. " * 8
    first_text = text.replace("river", "brook")
    common = {"model": "tiny-gemma4", "max_tokens": 2, "temperature": 0}
    first = server.chat.completions.create(
        messages=[{"role": "user", "content": first_text}], **common
    )
    assert first.usage.prompt_tokens_details is None
    messages = [{"role": "user", "content": text}]
    server.chat.completions.create(messages=messages, **common)
    again = server.chat.completions.create(messages=messages, **common).usage
    assert 0.8 * again.prompt_tokens <= again.prompt_tokens_details.cached_tokens
    assert again.prompt_tokens_details.cached_tokens < again.prompt_tokens
    streamed = [
        c.usage
        for c in server.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **common
        )
        if c.usage is not None
    ]
    assert (
        streamed[-1].prompt_tokens_details.cached_tokens
        == again.prompt_tokens_details.cached_tokens
    )
    reply = server.responses.create(
        model="tiny-gemma4", input=text, max_output_tokens=2, temperature=0
    )
    assert reply.usage.input_tokens_details.cached_tokens > 0
    prompt_ids = (
        server.completions.create(
            prompt=text, extra_body={"return_token_ids": True}, **{**common, "max_tokens": 1}
        )
        .choices[0]
        .prompt_token_ids
    )
    completion = server.completions.create(prompt=prompt_ids, **common).usage
    assert completion.prompt_tokens_details.cached_tokens >= 0.8 * completion.prompt_tokens
