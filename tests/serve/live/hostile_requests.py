"""Request builders and the case type of the hostile-input table
(tests/serve/live/hostile_cases.py): bodies, raw requests, media parts, data URLs, tool
definitions, and the wrong-type case of every top-level field of ChatCompletionRequest."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MODEL = "tiny-gemma4"
API_KEY = "sk-hostile-5e1f0c2b9d7a44c1"
MiB = 1024 * 1024


@dataclass
class Req:
    """One HTTP request. `json` bodies have `{root}`-style names filled in from the context;
    `raw` is written to the socket as-is (for headers no client library would send)."""

    json: Any = None
    body: bytes | None = None
    raw: bytes | None = None
    method: str = "POST"
    path: str = "/v1/chat/completions"
    headers: dict[str, str] = field(default_factory=dict)
    auth: bool = True


@dataclass(frozen=True)
class Case:
    id: str
    category: str
    what: str  # the input, in words (the doc's "input" column)
    request: Any  # a JSON body (dict), a Req, or ctx -> Req
    status: int
    code: str
    needles: tuple[str, ...] = ()  # must appear in error.message (formatted with the context)
    param: str | None = None  # error.param, when the case pins it


def chat(content: Any, **fields: Any) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        **fields,
    }


def media(kind: str, url: str, **options: Any) -> list[dict]:
    """A user content list: one `<kind>_url` part, then a question."""
    key = f"{kind}_url"
    return [{"type": key, key: {"url": url, **options}}, {"type": "text", "text": "What is it?"}]


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{b64(data)}"


def data_url_wrapped(mime: str, data: bytes) -> str:
    """A data URL whose base64 is wrapped at 76 columns, MIME style."""
    return f"data:{mime};base64,{base64.encodebytes(data).decode()}"


def raw_json(text: str) -> Req:
    return Req(body=text.encode())


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def many_parts(num_per_message: list[int]) -> dict:
    text = {"type": "text", "text": "x"}
    messages = [{"role": "user", "content": [text] * n} for n in num_per_message]
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


def text_parts_body(num_parts: int) -> Req:
    """One user message of `num_parts` empty text parts, as raw JSON (no big list to dump)."""
    parts = ", ".join(['{"type": "text", "text": ""}'] * num_parts)
    return raw_json('{"messages": [{"role": "user", "content": [' + parts + "]}]}")


def empty_arrays_body(num_arrays: int) -> Req:
    arrays = ",".join(["[]"] * num_arrays)
    return raw_json(
        '{"messages": [{"role": "user", "content": "hi"}], "metadata": [' + arrays + "]}"
    )


def input_audio(data: str, fmt: str = "wav") -> list[dict]:
    return [{"type": "input_audio", "input_audio": {"data": data, "format": fmt}}]


def assistant_call(arguments: Any) -> dict:
    """A request whose history holds one assistant tool call with these `arguments`."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return chat("hi") | {"messages": [{"role": "assistant", "tool_calls": [call]}]}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


JINJA_LOOP = "{% for i in range(10**9) %}x{% endfor %}"
UNKNOWN_TYPE = {"type": "object", "properties": {"x": {"type": "strnig"}}}


def tool(name: str = "zoom", parameters: Any = None, **function: Any) -> dict:
    if parameters is None:
        parameters = {"type": "object", "properties": {"x": {"type": "number"}}}
    return {"type": "function", "function": {"name": name, "parameters": parameters, **function}}


def declared_body(length: int, prefix: bytes) -> Callable:
    """POST headers declaring `length` body bytes, followed by only `prefix` of them."""

    def build(ctx) -> Req:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{ctx.port}\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n"
        )
        return Req(raw=head.encode() + prefix)

    return build


def over_cap_data_url() -> bytes:
    """The first MiB of a body whose data URL alone is 130 MiB (declared in full)."""
    head = b'{"model": "tiny-gemma4", "messages": [{"role": "user", "content": ['
    return head + b'{"type": "image_url", "image_url": {"url": "data:image/png;base64,' + b"A" * MiB


# Every top-level field of ChatCompletionRequest with a value of the wrong JSON type.
WRONG_TYPES: dict[str, Any] = {
    "model": 5,
    "messages": "hello",
    "tools": {"type": "function"},
    "tool_choice": 5,
    "parallel_tool_calls": "maybe",
    "temperature": "hot",
    "top_p": [],
    "top_k": 1.5,
    "min_p": "low",
    "presence_penalty": {},
    "frequency_penalty": [1],
    "repetition_penalty": "x",
    "seed": 1.5,
    "n": "two",
    "max_tokens": "many",
    "max_completion_tokens": 2.5,
    "stop": 5,
    "stop_token_ids": "eos",
    "ignore_eos": "sometimes",
    "return_token_ids": "please",
    "logprobs": 3,
    "top_logprobs": "all",
    "stream": "yes please",
    "stream_options": [],
    "user": 5,
    "chat_template_kwargs": [],
    "metadata": "x",
    "logit_bias": "x",
    "min_tokens": "few",
    "response_format": "json",
}

# OpenAI fields AReno does not implement: any value but the neutral one is refused, naming the field.
UNSUPPORTED_VALUES: dict[str, Any] = {
    "store": True,
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "hello"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
    "service_tier": "flex",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "best_of": 2,
    "prompt_cache_key": "k",
    "safety_identifier": "u1",
}


def wrong_type_cases() -> list[Case]:
    cases = []
    for name, value in WRONG_TYPES.items():
        body = chat("hi") | {name: value}
        what = f"`{name}`: {json.dumps(value)}"
        cases.append(Case(f"wrong_type_{name}", "field types", what, body, 400, "invalid_request",
                          (name,), param=name))  # fmt: skip
    for name, value in UNSUPPORTED_VALUES.items():
        body = chat("hi") | {name: value}
        what = f"`{name}`: {json.dumps(value)}"
        cases.append(Case(f"unsupported_{name}", "unsupported fields", what, body, 400,
                          "invalid_request", (name, "not supported"), param=name))  # fmt: skip
    return cases
