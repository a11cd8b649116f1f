"""The hostile-input table of tests/serve/test_hostile_inputs.py: each case is one request, the
status it must get, and the OpenAI error code and message words that must name the cause.

A case's request is a JSON body (a dict), a `Req` (raw bytes, headers, another route), or a
function of the test's context returning either. Strings in JSON bodies may name context fields
as `{root}` (the allowed media root), `{outside}` / `{outside_name}` (a directory next to it),
`{loopback}` / `{loopback_port}` (an HTTP server on 127.0.0.1) and `{public}` (one on 127.0.0.2,
which the app treats as a public host).
"""

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
    "logprobs": 3,
    "top_logprobs": "all",
    "stream": "yes please",
    "stream_options": [],
    "user": 5,
    "chat_template_kwargs": [],
    "metadata": "x",
}


def _wrong_type_cases() -> list[Case]:
    cases = []
    for name, value in WRONG_TYPES.items():
        body = chat("hi") | {name: value}
        what = f"`{name}`: {json.dumps(value)}"
        cases.append(Case(f"wrong_type_{name}", "field types", what, body, 400, "invalid_request",
                          (name,), param=name))  # fmt: skip
    return cases


INVALID = "invalid_request"
# fmt: off
CASES: list[Case] = [
    # --- the body itself ---
    Case("invalid_utf8_body", "body", "body bytes `\\xff\\xfe` inside a JSON string",
         Req(body=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'), 400, INVALID,
         ("not valid UTF-8",)),
    Case("truncated_json", "body", '`{"messages": [`', raw_json('{"messages": ['), 400, INVALID,
         ("not valid JSON",)),
    Case("empty_body", "body", "an empty body", Req(body=b""), 400, INVALID, ("not valid JSON",)),
    Case("body_is_an_array", "body", "a JSON array instead of an object",
         raw_json('[{"role": "user", "content": "hi"}]'), 400, INVALID,
         ("must be a JSON object",)),
    Case("nan_temperature", "body", '`"temperature": NaN`',
         raw_json('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'), 400,
         INVALID, ("NaN is not a JSON number",)),
    Case("infinite_max_tokens", "body", '`"max_tokens": Infinity`',
         raw_json('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": Infinity}'),
         400, INVALID, ("Infinity is not a JSON number",)),
    Case("lone_surrogate", "body", "text holding the escape `\\ud800` (a lone surrogate)",
         raw_json('{"messages": [{"role": "user", "content": "a\\ud800b"}]}'), 400, INVALID,
         ("lone UTF-16 surrogate",)),
    Case("nested_100_deep", "body", "`metadata` nested 100 arrays deep",
         chat("hi", metadata={"x": nested(100)}), 400, INVALID,
         ("nests deeper than the limit of 64",)),
    Case("nested_100000_deep", "body", "`[` repeated 100 000 times",
         raw_json('{"metadata": ' + "[" * 100_000 + "]" * 100_000 + "}"), 400, INVALID,
         ("nests deeper than the limit",)),
    Case("million_tiny_parts", "body", "one message of 1 000 000 text parts (29 MB)",
         text_parts_body(1_000_000), 413, "request_too_large", ("JSON values",)),
    Case("five_million_empty_arrays", "body", "`metadata` holding 5 000 000 empty arrays (15 MB)",
         empty_arrays_body(5_000_000), 413, "request_too_large", ("JSON values",)),
    Case("parts_per_message_limit_plus_one", "body", "513 text parts in one message",
         many_parts([513]), 400, INVALID,
         ("513 content parts exceed the limit of 512 per message",)),
    Case("parts_per_request_limit_plus_one", "body", "2 049 text parts over 5 messages",
         many_parts([512, 512, 512, 512, 1]), 400, INVALID,
         ("2049 content parts exceed the limit of 2048 per request",)),
    Case("messages_limit_plus_one", "body", "4 097 messages", many_parts([1] * 4097), 400, INVALID,
         ("4097 messages exceed the limit of 4096",)),
    Case("declared_body_over_cap", "body",
         "`Content-Length: 200000000`, then only 40 bytes of body",
         declared_body(200_000_000, b'{"messages": [{"role": "user", "content":'), 413,
         "request_too_large", ("200000000 bytes", "134217728")),
    Case("data_url_over_size_cap", "body",
         "a 130 MiB image data URL (Content-Length declares it; refused before it is read)",
         declared_body(130 * MiB + 200, over_cap_data_url()), 413, "request_too_large",
         ("134217728",)),
    # --- field values ---
    Case("empty_messages", "field values", "`messages`: []", chat("hi") | {"messages": []}, 400,
         INVALID, ("messages",), param="messages"),
    Case("temperature_3", "field values", "`temperature`: 3", chat("hi", temperature=3), 400,
         INVALID, ("less than or equal to 2",), param="temperature"),
    Case("top_p_0", "field values", "`top_p`: 0", chat("hi", top_p=0), 400, INVALID,
         ("greater than 0",), param="top_p"),
    Case("top_k_0", "field values", "`top_k`: 0", chat("hi", top_k=0), 400, INVALID,
         ("-1 (disabled) or at least 1",), param="top_k"),
    Case("n_0", "field values", "`n`: 0", chat("hi", n=0), 400, INVALID,
         ("greater than or equal to 1",), param="n"),
    Case("n_over_limit", "field values", "`n`: 17 (the protocol's limit is 16)", chat("hi", n=17),
         400, INVALID, ("less than or equal to 16",), param="n"),
    Case("n_over_cache_slots", "field values", "`n`: 3 with 2 cache slots", chat("hi", n=3), 400,
         "too_many_samples", ("n=3", "--max-running-prompts"), param="n"),
    Case("negative_max_tokens", "field values", "`max_tokens`: -1", chat("hi", max_tokens=-1), 400,
         INVALID, ("greater than or equal to 1",), param="max_tokens"),
    Case("zero_max_tokens", "field values", "`max_tokens`: 0", chat("hi", max_tokens=0), 400,
         INVALID, ("greater than or equal to 1",), param="max_tokens"),
    Case("huge_max_tokens", "field values", "`max_tokens`: 10**30", chat("hi", max_tokens=10**30),
         400, "context_length_exceeded", ("context is 2048 tokens", "lower max_tokens")),
    Case("max_completion_tokens_over_context", "field values", "`max_completion_tokens`: 4096",
         chat("hi", max_completion_tokens=4096), 400, "context_length_exceeded",
         ("context is 2048 tokens",)),
    Case("seed_2_pow_64", "field values", "`seed`: 2**64", chat("hi", seed=2 ** 64), 400, INVALID,
         ("seed",), param="seed"),
    Case("top_logprobs_21", "field values", "`top_logprobs`: 21 with logprobs",
         chat("hi", logprobs=True, top_logprobs=21), 400, INVALID, ("less than or equal to 20",),
         param="top_logprobs"),
    Case("top_logprobs_without_logprobs", "field values", "`top_logprobs`: 2, `logprobs`: false",
         chat("hi", logprobs=False, top_logprobs=2), 400, INVALID, ("requires 'logprobs': true",)),
    Case("stream_options_without_stream", "field values", "`stream_options` with `stream`: false",
         chat("hi", stream_options={"include_usage": True}), 400, INVALID, ("'stream': true",)),
    Case("seventeen_stop_sequences", "field values", "17 stop strings",
         chat("hi", stop=[f"s{i}" for i in range(17)]), 400, INVALID,
         ("17 stop sequences exceed the limit of 16",)),
    Case("empty_stop_string", "field values", '`stop`: [""]', chat("hi", stop=[""]), 400, INVALID,
         ("at least 1 character",)),
    Case("negative_stop_token_id", "field values", "`stop_token_ids`: [-1]",
         chat("hi", stop_token_ids=[-1]), 400, INVALID, ("greater than or equal to 0",)),
    Case("unknown_model", "field values", '`model`: "gpt-4o"', chat("hi", model="gpt-4o"), 404,
         "model_not_found", ("'gpt-4o' is not served here",), param="model"),
    Case("prompt_over_max_prompt_tokens", "field values", "2 000 words of text (limit 900 tokens)",
         chat("word " * 2000), 400, "context_length_exceeded", ("--max-prompt-tokens=900",)),
    Case("template_kwargs_tokenize", "field values", '`chat_template_kwargs`: {"tokenize": true}',
         chat("hi", chat_template_kwargs={"tokenize": True}), 400, INVALID,
         ("'tokenize'", "cannot be set here"), param="chat_template_kwargs"),
    Case("template_kwargs_messages", "field values", '`chat_template_kwargs`: {"messages": []}',
         chat("hi", chat_template_kwargs={"messages": []}), 400, INVALID, ("'messages'",)),
    Case("template_kwargs_generation_prompt", "field values",
         '`chat_template_kwargs`: {"add_generation_prompt": false}',
         chat("hi", chat_template_kwargs={"add_generation_prompt": False}), 400, INVALID,
         ("'add_generation_prompt'",)),
    Case("template_kwargs_own_template", "field values",
         '`chat_template_kwargs`: {"chat_template": <a Jinja loop of 10**9>}',
         chat("hi", chat_template_kwargs={"chat_template": JINJA_LOOP}), 400, INVALID,
         ("'chat_template'",)),
    # --- messages and content parts ---
    Case("unknown_role", "messages", '`role`: "wizard"',
         chat("hi") | {"messages": [{"role": "wizard", "content": "hi"}]}, 400, INVALID,
         ("unknown role 'wizard'",), param="messages[0].role"),
    Case("content_is_a_number", "messages", "`content`: 42", chat(42), 400, INVALID,
         ("string or an array of content parts",)),
    Case("unknown_part_type", "messages", 'a part of type "image_file"',
         chat([{"type": "image_file", "file_id": "x"}]), 400, INVALID,
         ("unknown type 'image_file'",)),
    Case("image_url_without_url", "messages", "`image_url`: {}",
         chat([{"type": "image_url", "image_url": {}}]), 400, INVALID, ("Field required",),
         param="messages[0].content[0].image_url.url"),
    Case("image_url_empty", "messages", '`image_url.url`: ""', chat(media("image", "")), 400,
         INVALID, ("at least 1 character",)),
    Case("misspelt_part_key", "messages", "`image_url.uri` instead of `url`",
         chat([{"type": "image_url", "image_url": {"uri": "/x.png"}}]), 400, INVALID,
         ("Unknown field",)),
    Case("image_in_system_message", "messages", "an image part in a system message",
         chat("hi") | {"messages": [{"role": "system", "content": media("image", "/x.png")}]}, 400,
         INVALID, ("only text parts are allowed",)),
    Case("input_audio_data_url", "messages", "`input_audio.data` given as a data: URL",
         chat(input_audio("data:audio/wav;base64,UklG")), 400, INVALID, ("must be bare base64",)),
    Case("input_audio_unknown_format", "messages", '`input_audio.format`: "exe"',
         chat(input_audio("UklG", "exe")), 400, INVALID, ("format",)),
    Case("video_negative_fps", "messages", "`video_url.fps`: -1",
         chat(media("video", "{root}/clip.mp4", fps=-1)), 400, INVALID, ("greater than 0",)),
    Case("tool_message_without_id", "messages", "a tool message without `tool_call_id`",
         chat("hi") | {"messages": [{"role": "tool", "content": "42"}]}, 400, INVALID,
         ("tool_call_id",)),
    Case("tool_call_arguments_number", "messages", "assistant tool call `arguments`: 5",
         assistant_call(5), 400, INVALID, ("JSON string or an object",)),
    # --- tools ---
    Case("tool_schema_type_string", "tools", '`parameters`: {"type": "string"}',
         chat("hi", tools=[tool(parameters={"type": "string"})]), 400, INVALID,
         ('"type": "object"',)),
    Case("tool_schema_is_a_string", "tools", '`parameters`: "{\\"type\\": \\"object\\"}"',
         chat("hi", tools=[tool(parameters='{"type": "object"}')]), 400, INVALID,
         ("JSON object",)),
    Case("tool_schema_properties_number", "tools", "`parameters.properties`: 5",
         chat("hi", tools=[tool(parameters={"type": "object", "properties": 5})]), 400, INVALID,
         ("properties",)),
    Case("tool_schema_required_string", "tools", '`parameters.required`: "x"',
         chat("hi", tools=[tool(parameters={"type": "object", "required": "x"})]), 400, INVALID,
         ("required",)),
    Case("tool_schema_unknown_type", "tools", 'a property of `type` "strnig"',
         chat("hi", tools=[tool(parameters=UNKNOWN_TYPE)]), 400, INVALID, ("strnig",)),
    Case("tool_name_with_spaces", "tools", 'function name "rm -rf /"',
         chat("hi", tools=[tool("rm -rf /")]), 400, INVALID, ("should match pattern",)),
    Case("duplicate_tool_names", "tools", 'two tools named "zoom"',
         chat("hi", tools=[tool(), tool()]), 400, INVALID, ("repeated: zoom",)),
    Case("tool_choice_unknown_tool", "tools", "`tool_choice` naming a tool not in `tools`",
         chat("hi", tools=[tool()], tool_choice={"type": "function", "function": {"name": "pan"}}),
         400, INVALID, ("'pan'",)),
    Case("tool_choice_required_without_tools", "tools", '`tool_choice`: "required", no tools',
         chat("hi", tool_choice="required"), 400, INVALID, ("non-empty 'tools'",)),
    Case("tools_limit_plus_one", "tools", "257 tools",
         chat("hi", tools=[tool(f"t{i}") for i in range(257)]), 400, INVALID,
         ("257 tools exceed the limit of 256",)),
    Case("tool_type_retrieval", "tools", 'a tool of `type` "retrieval"',
         chat("hi", tools=[{"type": "retrieval"}]), 400, INVALID, ("function",)),
    # --- access ---
    Case("no_api_key", "access", "no Authorization header", Req(json=chat("hi"), auth=False), 401,
         "invalid_api_key", ("API key",)),
    Case("wrong_api_key", "access", "`Authorization: Bearer sk-wrong`",
         Req(json=chat("hi"), auth=False, headers={"Authorization": "Bearer sk-wrong"}), 401,
         "invalid_api_key", ("API key",)),
    Case("api_key_in_query", "access", "the key as `?api_key=` instead of a header",
         Req(json=chat("hi"), auth=False, path=f"/v1/chat/completions?api_key={API_KEY}"), 401,
         "invalid_api_key", ("API key",)),
    Case("basic_auth", "access", "`Authorization: Basic <key>`",
         Req(json=chat("hi"), auth=False, headers={"Authorization": f"Basic {API_KEY}"}), 401,
         "invalid_api_key", ("API key",)),
    Case("models_without_key", "access", "`GET /v1/models` without a key",
         Req(method="GET", path="/v1/models", auth=False), 401, "invalid_api_key", ("API key",)),
    Case("openapi_without_key", "access", "`GET /openapi.json` without a key",
         Req(method="GET", path="/openapi.json", auth=False), 404, "not_found", ("Not Found",)),
    Case("unknown_route", "access", "`POST /v1/completions`",
         Req(json={"prompt": "hi"}, path="/v1/completions"), 404, "not_found", ("Not Found",)),
    Case("wrong_method", "access", "`GET /v1/chat/completions`", Req(method="GET"), 405,
         "method_not_allowed", ("Method Not Allowed",)),
    # --- images ---
    Case("png_header_bomb", "images", "a PNG header declaring 100 000 x 100 000, no pixels",
         chat(media("image", "{root}/header_bomb.png")), 413, "media_too_large",
         ("10000000000", "max_image_pixels")),
    Case("png_compressible_giant", "images", "a complete 9 000 x 9 000 PNG of zeros (79 KB)",
         chat(media("image", "{root}/giant_zeros.png")), 413, "media_too_large", ("9000x9000",)),
    Case("png_ztxt_bomb", "images", "a PNG with a zTXt chunk inflating to 8 MB",
         chat(media("image", "{root}/ztxt_bomb.png")), 400, "media_decode_failed",
         ("MAX_TEXT_CHUNK",)),
    Case("png_iccp_bomb", "images", "a PNG with an iCCP profile inflating to 8 MB",
         chat(media("image", "{root}/iccp_bomb.png")), 400, "media_decode_failed",
         ("MAX_TEXT_CHUNK",)),
    Case("jpeg_huge_dimensions", "images", "a JPEG whose SOF0 declares 65 500 x 65 500",
         chat(media("image", "{root}/huge.jpg")), 413, "media_too_large", ("4290250000",)),
    Case("gif_huge_screen", "images", "a GIF whose screen is 65 535 x 65 535",
         chat(media("image", "{root}/huge_screen.gif")), 413, "media_too_large", ("pixels",)),
    Case("bmp_huge_dimensions", "images", "a BMP declaring 60 000 x 60 000",
         chat(media("image", "{root}/huge.bmp")), 413, "media_too_large", ("3600000000",)),
    Case("svg_as_image", "images", "an SVG document named .png",
         chat(media("image", "{root}/svg.png")), 400, "media_decode_failed",
         ("not a recognised image format",)),
    Case("eps_as_image", "images", "a PostScript (EPS) file named .png",
         chat(media("image", "{root}/eps.png")), 400, "media_decode_failed",
         ("not a recognised image format",)),
    Case("truncated_png", "images", "the first half of a PNG",
         chat(media("image", "{root}/truncated.png")), 400, "media_decode_failed", ("truncated",)),
    Case("wav_as_image", "images", "a WAV file sent as an image",
         chat(media("image", "{root}/tone.wav")), 400, "media_decode_failed",
         ("not a recognised image format",)),
    Case("data_url_mime_lies", "images", "`data:image/png` holding WAV bytes",
         lambda ctx: chat(media("image", data_url("image/png", ctx.files["tone.wav"]))), 400,
         "media_decode_failed", ("data URL (image/png",)),
    Case("audio_data_url_as_image", "images", "a `data:audio/wav` URL in an image part",
         lambda ctx: chat(media("image", data_url("audio/wav", ctx.files["tone.wav"]))), 415,
         "unsupported_media_type", ("'audio/wav' was given as image",)),
    Case("html_data_url_as_image", "images", "a `data:text/html` URL in an image part",
         chat(media("image", "data:text/html;base64,PGh0bWw+")), 415, "unsupported_media_type",
         ("'text/html'",)),
    Case("data_url_without_mime", "images", "`data:;base64,...`",
         chat(media("image", "data:;base64,iVBORw0KGgo=")), 415, "unsupported_media_type",
         ("no MIME type",)),
    Case("data_url_without_comma", "images", "`data:image/png;base64` and no comma",
         chat(media("image", "data:image/png;base64")), 400, "invalid_media_url", ("no ','",)),
    Case("malformed_base64", "images", "`data:image/png;base64,iVBORw0K@@@`",
         chat(media("image", "data:image/png;base64,iVBORw0K@@@")), 400, "invalid_media_url",
         ("invalid base64",)),
    Case("base64_with_line_breaks", "images", "base64 wrapped at 76 columns (MIME style)",
         lambda ctx: chat(media("image", data_url_wrapped("image/png", ctx.files["image.png"]))),
         400, "invalid_media_url", ("invalid base64",)),
    Case("secret_text_as_image", "images", "a text file holding a secret, inside the root",
         chat(media("image", "{root}/secret_as_text.png")), 400, "media_decode_failed",
         ("secret_as_text.png",)),
    # --- audio ---
    Case("wav_rate_1hz_2000s", "audio", "a WAV declaring 1 Hz, 2 000 frames (2 000 s)",
         chat(media("audio", "{root}/rate1_2000s.wav")), 413, "media_too_large",
         ("2000", "max_audio_seconds")),
    Case("wav_rate_0", "audio", "a WAV declaring a sample rate of 0",
         chat(media("audio", "{root}/rate0.wav")), 400, "media_decode_failed", ("rate0.wav",)),
    Case("wav_rate_4ghz", "audio", "a WAV declaring 4 294 967 295 Hz",
         chat(media("audio", "{root}/rate_max.wav")), 400, "media_decode_failed",
         ("rate_max.wav",)),
    Case("wav_rate_2ghz", "audio", "a WAV of 2 000 frames at 2 GHz (1 microsecond)",
         chat(media("audio", "{root}/rate_2ghz.wav")), 400, "media_decode_failed",
         ("contains no samples",)),
    Case("flac_declaring_50_days", "audio", "a FLAC whose STREAMINFO claims 2**36 samples",
         chat(media("audio", "{root}/50_days.flac")), 413, "media_too_large",
         ("max_audio_seconds",)),
    Case("text_as_wav", "audio", "text named .wav", chat(media("audio", "{root}/text.wav")), 400,
         "media_decode_failed", ("FFmpeg cannot open it",)),
    Case("zero_length_wav", "audio", "a WAV with no samples",
         chat(media("audio", "{root}/empty.wav")), 400, "media_decode_failed",
         ("contains no samples",)),
    Case("png_as_audio", "audio", "a PNG sent as audio", chat(media("audio", "{root}/image.png")),
         400, "media_decode_failed", ("has no audio stream",)),
    Case("input_audio_holding_png", "audio", "`input_audio` (format wav) holding PNG bytes",
         lambda ctx: chat(input_audio(b64(ctx.files["image.png"]))), 400, "media_decode_failed",
         ("audio/wav",)),
    Case("input_audio_bad_base64", "audio", '`input_audio.data`: "%%%"', chat(input_audio("%%%")),
         400, "invalid_media_url", ("invalid base64",)),
    # --- video ---
    Case("mp4_ftyp_only", "video", "an MP4 that is its ftyp box alone",
         chat(media("video", "{root}/ftyp_only.mp4")), 400, "media_decode_failed",
         ("FFmpeg cannot open it",)),
    Case("mp4_truncated", "video", "the first half of an MP4",
         chat(media("video", "{root}/truncated.mp4")), 400, "media_decode_failed",
         ("truncated.mp4",)),
    Case("mp4_zeroed_stsd", "video", "an MP4 whose sample description box is zeroed",
         chat(media("video", "{root}/zeroed_stsd.mp4")), 400, "media_decode_failed",
         ("zeroed_stsd.mp4",)),
    Case("mp4_zeroed_stco", "video", "an MP4 whose chunk offset table is zeroed",
         chat(media("video", "{root}/zeroed_stco.mp4")), 400, "media_decode_failed",
         ("zeroed_stco.mp4",)),
    Case("mp4_without_video_stream", "video", "an MP4 holding only an audio stream",
         chat(media("video", "{root}/audio_only.mp4")), 400, "media_decode_failed",
         ("has no video stream",)),
    Case("webm_without_frame_rate", "video", "a WebM whose stream has no frame rate",
         chat(media("video", "{root}/nofps.webm")), 400, "video_missing_frame_rate",
         ("frame-rate metadata",)),
    Case("video_frames_over_pixel_cap", "video",
         "an MJPEG video of 4 200 x 4 200 frames (flat, 280 KB)",
         chat(media("video", "{root}/frames_over_cap.mkv")), 413, "media_too_large",
         ("4200x4200", "max_video_frame_pixels")),
    Case("video_frames_lying_about_size", "video",
         "a 32 x 32 MJPEG video whose frames declare 16 000 x 16 000",
         chat(media("video", "{root}/frames_lying.mkv")), 400, "media_decode_failed",
         ("frames_lying.mkv",)),
    Case("ffconcat_playlist", "video", "an ffconcat playlist naming a file outside the root",
         chat(media("video", "{root}/playlist.mp4")), 400, "media_decode_failed",
         ("FFmpeg cannot open it",)),
    Case("hls_playlist", "video", "an HLS playlist naming a file:// URL outside the root",
         chat(media("video", "{root}/hls.mp4")), 400, "media_decode_failed", ("hls.mp4",)),
    Case("text_as_video", "video", "text named .wav sent as video",
         chat(media("video", "{root}/text.wav")), 400, "media_decode_failed",
         ("FFmpeg cannot open it",)),
    # --- local paths ---
    Case("dotdot_traversal", "local paths", "`<root>/../<outside>/secret.png`",
         chat(media("image", "{root}/../{outside_name}/secret.png")), 403, "media_access_denied",
         ("outside the allowed roots",)),
    Case("symlink_escape", "local paths", "a symlink in the root to a file outside it",
         chat(media("image", "{root}/escape.png")), 403, "media_access_denied",
         ("resolves to '{outside}/secret.png'",)),
    Case("absolute_path_outside", "local paths", "`/etc/passwd`",
         chat(media("image", "/etc/passwd")), 403, "media_access_denied",
         ("outside the allowed",)),
    Case("proc_environ", "local paths", "`/proc/self/environ`",
         chat(media("image", "/proc/self/environ")), 403, "media_access_denied",
         ("outside the allowed",)),
    Case("symlink_to_dev_zero", "local paths", "a symlink in the root to /dev/zero",
         chat(media("image", "{root}/dev_zero.png")), 403, "media_access_denied", ("/dev/zero",)),
    Case("relative_escape", "local paths", "`../../etc/passwd` (relative to the worker's cwd)",
         chat(media("image", "../../etc/passwd")), 403, "media_access_denied",
         ("outside the allowed",)),
    Case("fifo_in_root", "local paths", "a FIFO in the root (would block a reader)",
         chat(media("image", "{root}/fifo.png")), 400, "media_not_found", ("not a regular file",)),
    Case("directory_in_root", "local paths", "a directory in the root",
         chat(media("image", "{root}/a_directory.png")), 400, "media_not_found",
         ("is a directory",)),
    Case("missing_file", "local paths", "a file that does not exist in the root",
         chat(media("image", "{root}/missing.png")), 400, "media_not_found",
         ("media file not found", "node")),
    Case("nul_byte_in_path", "local paths", "`<root>/image.png\\x00.txt`",
         chat(media("image", "{root}/image.png\x00.txt")), 400, "invalid_media_url",
         ("NUL byte",)),
    Case("sparse_file_over_byte_cap", "local paths", "a sparse 300 MiB file in the root",
         chat(media("image", "{root}/sparse_300mb.png")), 413, "media_too_large",
         ("over the limit of 268435456 bytes",)),
    # --- file:// URLs ---
    Case("file_url_remote_host", "file URLs", "`file://fileserver/etc/passwd`",
         chat(media("image", "file://fileserver/etc/passwd")), 415, "unsupported_media_type",
         ("'fileserver'",)),
    Case("file_url_ip_host", "file URLs", "`file://127.0.0.1/etc/passwd`",
         chat(media("image", "file://127.0.0.1/etc/passwd")), 415, "unsupported_media_type",
         ("'127.0.0.1'",)),
    Case("file_url_outside", "file URLs", "`file:///etc/passwd`",
         chat(media("image", "file:///etc/passwd")), 403, "media_access_denied",
         ("outside the allowed",)),
    Case("file_url_localhost_dotdot", "file URLs", "`file://localhost<root>/../<outside>/...`",
         chat(media("image", "file://localhost{root}/../{outside_name}/secret.png")), 403,
         "media_access_denied", ("outside the allowed",)),
    Case("file_url_percent_encoded_dots", "file URLs", "`file://<root>/%2e%2e/<outside>/...`",
         chat(media("image", "file://{root}/%2e%2e/{outside_name}/secret.png")), 403,
         "media_access_denied", ("outside the allowed",)),
    Case("file_url_percent_encoded_slash", "file URLs", "`file://<root>/..%2f<outside>/...`",
         chat(media("image", "file://{root}/..%2f{outside_name}/secret.png")), 403,
         "media_access_denied", ("outside the allowed",)),
    Case("file_url_double_slash", "file URLs", "`file:////etc/passwd`",
         chat(media("image", "file:////etc/passwd")), 403, "media_access_denied",
         ("outside the allowed",)),
    Case("file_url_encoded_nul", "file URLs", "`file://<root>/image.png%00.txt`",
         chat(media("image", "file://{root}/image.png%00.txt")), 400, "invalid_media_url",
         ("NUL byte",)),
    Case("file_url_relative", "file URLs", "`file:image.png`",
         chat(media("image", "file:image.png")), 400, "invalid_media_url", ("absolute path",)),
    Case("file_url_upper_case", "file URLs", "`FILE:///etc/passwd`",
         chat(media("image", "FILE:///etc/passwd")), 403, "media_access_denied",
         ("outside the allowed",)),
    # --- remote URLs (SSRF) ---
    Case("ssrf_loopback_server", "SSRF", "the test's HTTP server on 127.0.0.1",
         chat(media("image", "{loopback}/file/image.png")), 403, "media_access_denied",
         ("127.0.0.1", "--allow-private-media-urls")),
    Case("ssrf_localhost_name", "SSRF", "`http://localhost:<port>/`",
         chat(media("image", "http://localhost:{loopback_port}/file/image.png")), 403,
         "media_access_denied", ("resolves to",)),
    Case("ssrf_ipv6_loopback", "SSRF", "`http://[::1]/`", chat(media("image", "http://[::1]/a")),
         403, "media_access_denied", ("::1",)),
    Case("ssrf_metadata_service", "SSRF", "`http://169.254.169.254/latest/meta-data/`",
         chat(media("image", "http://169.254.169.254/latest/meta-data/")), 403,
         "media_access_denied", ("169.254.169.254",)),
    Case("ssrf_private_10", "SSRF", "`http://10.0.0.1/`",
         chat(media("image", "http://10.0.0.1/a")), 403, "media_access_denied", ("10.0.0.1",)),
    Case("ssrf_private_192_168", "SSRF", "`http://192.168.1.1/`",
         chat(media("image", "http://192.168.1.1/a")), 403, "media_access_denied",
         ("192.168.1.1",)),
    Case("ssrf_private_172_16", "SSRF", "`http://172.16.0.1/`",
         chat(media("image", "http://172.16.0.1/a")), 403, "media_access_denied", ("172.16.0.1",)),
    Case("ssrf_carrier_nat", "SSRF", "`http://100.64.0.1/` (shared address space)",
         chat(media("image", "http://100.64.0.1/a")), 403, "media_access_denied", ("100.64.0.1",)),
    Case("ssrf_unspecified", "SSRF", "`http://0.0.0.0:<port>/`",
         chat(media("image", "http://0.0.0.0:{loopback_port}/file/image.png")), 403,
         "media_access_denied", ("0.0.0.0",)),
    Case("ssrf_decimal_ip", "SSRF", "`http://2130706433:<port>/` (127.0.0.1 as one number)",
         chat(media("image", "http://2130706433:{loopback_port}/file/image.png")), 403,
         "media_access_denied", ("127.0.0.1",)),
    Case("ssrf_octal_ip", "SSRF", "`http://0177.0.0.1:<port>/`",
         chat(media("image", "http://0177.0.0.1:{loopback_port}/file/image.png")), 403,
         "media_access_denied", ("127.0.0.1",)),
    Case("ssrf_hex_ip", "SSRF", "`http://0x7f.0.0.1:<port>/`",
         chat(media("image", "http://0x7f.0.0.1:{loopback_port}/file/image.png")), 403,
         "media_access_denied", ("127.0.0.1",)),
    Case("ssrf_short_ip", "SSRF", "`http://127.1:<port>/`",
         chat(media("image", "http://127.1:{loopback_port}/file/image.png")), 403,
         "media_access_denied", ("127.0.0.1",)),
    Case("ssrf_ipv4_mapped_ipv6", "SSRF", "`http://[::ffff:127.0.0.1]:<port>/`",
         chat(media("image", "http://[::ffff:127.0.0.1]:{loopback_port}/file/image.png")), 403,
         "media_access_denied", ("::ffff:127.0.0.1",)),
    Case("ssrf_mapped_metadata", "SSRF", "`http://[::ffff:a9fe:a9fe]/` (169.254.169.254 mapped)",
         chat(media("image", "http://[::ffff:a9fe:a9fe]/a")), 403, "media_access_denied",
         ("::ffff:",)),
    Case("ssrf_nat64_metadata", "SSRF", "`http://[64:ff9b::a9fe:a9fe]/` (NAT64)",
         chat(media("image", "http://[64:ff9b::a9fe:a9fe]/a")), 403, "media_access_denied",
         ("64:ff9b::",)),
    Case("ssrf_ipv6_link_local", "SSRF", "`http://[fe80::1]/`",
         chat(media("image", "http://[fe80::1]/a")), 403, "media_access_denied", ("fe80::1",)),
    Case("ssrf_userinfo_trick", "SSRF", "`http://<public>@127.0.0.1:<port>/`",
         chat(media("image", "http://127.0.0.2@127.0.0.1:{loopback_port}/file/image.png")), 403,
         "media_access_denied", ("127.0.0.1",)),
    Case("ssrf_redirect_to_loopback", "SSRF", "a public-looking server redirecting to 127.0.0.1",
         chat(media("image", "{public}/to?url={loopback}/file/image.png")), 403,
         "media_access_denied", ("127.0.0.1", "--allow-private-media-urls")),
    Case("ssrf_redirect_to_metadata", "SSRF", "a redirect to 169.254.169.254",
         chat(media("image", "{public}/to?url=http://169.254.169.254/latest/meta-data/")), 403,
         "media_access_denied", ("169.254.169.254",)),
    Case("ssrf_redirect_to_ipv6_loopback", "SSRF", "a redirect to `http://[::1]:<port>/`",
         chat(media("image", "{public}/to?url=http://[::1]:{loopback_port}/file/image.png")), 403,
         "media_access_denied", ("::1",)),
    Case("ssrf_redirect_to_file", "SSRF", "a redirect to `file:///etc/passwd`",
         chat(media("image", "{public}/to?url=file:///etc/passwd")), 403, "media_access_denied",
         ("only redirects to http(s)",)),
    Case("ssrf_redirect_to_gopher", "SSRF", "a redirect to `gopher://127.0.0.1:6379/`",
         chat(media("image", "{public}/to?url=gopher://127.0.0.1:6379/_INFO")), 403,
         "media_access_denied", ("only redirects to http(s)",)),
    Case("too_many_redirects", "SSRF", "a chain of 5 redirects (limit 3)",
         chat(media("image", "{public}/redirect/5")), 400, "media_fetch_failed",
         ("max_redirects=3",)),
    Case("ftp_scheme", "SSRF", "`ftp://127.0.0.1/a.png`",
         chat(media("image", "ftp://127.0.0.1/a")), 415, "unsupported_media_type", ("'ftp'",)),
    Case("gopher_scheme", "SSRF", "`gopher://127.0.0.1:6379/_INFO`",
         chat(media("image", "gopher://127.0.0.1:6379/_INFO")), 415, "unsupported_media_type",
         ("'gopher'",)),
    Case("url_without_host", "SSRF", "`http:///a.png`", chat(media("image", "http:///a.png")), 400,
         "invalid_media_url", ("has no host",)),
    Case("url_bad_port", "SSRF", "`http://127.0.0.1:99999/`",
         chat(media("image", "http://127.0.0.1:99999/a")), 400, "invalid_media_url",
         ("malformed",)),
    *_wrong_type_cases(),
]
# fmt: on
