"""A live AReno server (Ray Serve, tiny Gemma 4 checkpoint) driven by the official `openai`
client over loopback HTTP: every media source, streaming, n, logprobs, usage, queueing beyond
--max-running-prompts, overload refused with 429 beyond --max-queued-requests, tool_choice
enforcement, a LoRA adapter served beside the base model (`--lora`), errors answered 4xx
while the server keeps serving, and `/v1/completions` (text, token-id and batched prompts,
streaming, echo with prompt logprobs as an evaluation harness scores them)."""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import http.server
import json
import threading
from pathlib import Path

import jsonschema
import openai
import pytest
import ray
import torch
from ray import serve

from areno.engine.config import EngineConfig
from areno.media.samples import write_audio, write_image, write_video
from areno.serve.app import APP_NAME, build_app
from areno.serve.config import ServeConfig
from tests.serve.live.apps import PET_SCHEMA, deployed

MAX_PROMPT_TOKENS = 900
GUARDED_MAX_QUEUED = 1  # the guarded app: 2 running + 1 waiting, then 429


API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed-media")


@pytest.fixture(scope="module")
def lora(tiny_path, tmp_path_factory):
    """A PEFT adapter on the tiny Gemma 4 with random factors (large enough to change its
    greedy tokens), and the merged model: base weights plus the adapter's, as peft merges them."""
    from areno.models.registry import adapter_for_checkpoint
    from areno.train.lora import LoraConfig, apply_lora, export_adapter

    path = tiny_path("gemma4")
    torch.manual_seed(0)
    model = apply_lora(adapter_for_checkpoint(path).load_model(path), LoraConfig(rank=4, alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.normal_(0, 0.3)
    directory = export_adapter(model, path, tmp_path_factory.mktemp("lora") / "tiny-lora")
    return directory, model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def server(serve_port, tiny_path, media_root, lora):
    config = ServeConfig(
        model_path=str(tiny_path("gemma4")),
        served_model_name="tiny-gemma4",
        port=serve_port,
        engine=EngineConfig(max_running_prompts=2, max_context_len=2048),
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        allow_remote_media=True,
        allow_private_network_media=True,  # the test's HTTP server is on loopback
        lora_adapters={"tiny-lora": str(lora[0])},
    )
    # A second app: an API key, one allowed media root, remote media at its default (off),
    # a one-request waiting queue.
    guarded = dataclasses.replace(
        config,
        lora_adapters={},
        api_key=API_KEY,
        allowed_local_media_paths=(str(media_root),),
        max_queued_requests=GUARDED_MAX_QUEUED,
    )
    guarded = dataclasses.replace(
        guarded, allow_remote_media=False, allow_private_network_media=False
    )
    with deployed((APP_NAME, "/", config), ("guarded", "/guarded", guarded)):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="unused")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-media")
    return {
        "image": str(write_image(d / "a.png", 64, 48)),
        "audio": str(write_audio(d / "a.wav", seconds=1.0)),
        "video": str(write_video(d / "v.mp4", seconds=2.0, fps=4.0)),
        "dir": d,
    }


def ask(client, content, **kwargs):
    return client.chat.completions.create(
        model=kwargs.pop("model", "tiny-gemma4"),
        messages=[{"role": "user", "content": content}],
        max_tokens=kwargs.pop("max_tokens", 8),
        temperature=kwargs.pop("temperature", 0),
        **kwargs,
    )


def test_models_lists_the_served_model_and_its_adapter(server, lora):
    models = server.models.list()
    assert [m.id for m in models.data] == ["tiny-gemma4", "tiny-lora"]
    adapter = models.data[1].model_dump()
    assert adapter["parent"] == "tiny-gemma4" and adapter["root"] == str(lora[0])


def test_an_adapter_answers_as_the_merged_model_and_unlike_the_base(server, tiny_path, lora):
    """`model: tiny-lora` runs the adapter: its greedy reply is the merged model's (transformers
    generate on the same encoded prompt), and not the base model's; both asked at once."""
    from areno.processing import Processor

    question = "Tell me a story about a fox."
    processor = Processor(tiny_path("gemma4"))
    inputs = processor.encode([{"role": "user", "content": question}], [])
    out = lora[1].generate(**inputs.model_inputs(), max_new_tokens=8, do_sample=False)
    merged = processor.tokenizer.decode(
        out[0, inputs.num_prompt_tokens :], skip_special_tokens=True
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        adapted, base = pool.map(
            lambda model: ask(server, question, model=model, max_tokens=8),
            ["tiny-lora", "tiny-gemma4"],
        )
    assert adapted.model == "tiny-lora" and base.model == "tiny-gemma4"
    assert adapted.choices[0].message.content == merged
    assert base.choices[0].message.content != adapted.choices[0].message.content


def test_text_request_with_usage(server):
    response = ask(server, "Hello there!")
    choice = response.choices[0]
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in {"stop", "length"}
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == (
        response.usage.prompt_tokens + response.usage.completion_tokens
    )
    # No media tokens to report and no prompt cache (cached_tokens): the field is left out.
    assert response.usage.prompt_tokens_details is None


def test_every_media_source(server, media):
    with open(media["image"], "rb") as f:
        image_data_url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    with open(media["audio"], "rb") as f:
        audio_b64 = base64.b64encode(f.read()).decode()
    parts = [
        {"type": "image_url", "image_url": {"url": media["image"]}},
        {"type": "image_url", "image_url": {"url": image_data_url}},
        {"type": "input_audio", "input_audio": {"data": audio_b64, "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": media["audio"]}},
        {"type": "video_url", "video_url": {"url": media["video"]}},
        {"type": "text", "text": "What do you see and hear?"},
    ]
    response = ask(server, parts)
    details = response.usage.prompt_tokens_details
    assert details.image_tokens > 0 and details.audio_tokens > 0
    assert response.choices[0].message.content is not None


def test_streaming_matches_the_full_response(server, media):
    content = [
        {"type": "image_url", "image_url": {"url": media["image"]}},
        {"type": "text", "text": "Describe it."},
    ]
    full = ask(server, content, max_tokens=12)
    stream = ask(
        server, content, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_n_samples_with_logprobs(server):
    response = ask(
        server, "Pick a word.", n=2, temperature=1.0, seed=3, logprobs=True, top_logprobs=2
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        tokens = choice.logprobs.content
        assert tokens and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
    assert response.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in response.choices
    )


def test_more_samples_than_running_slots_are_all_answered(server):
    # The server runs 2 sequences at once: the other samples wait for a slot, never a 400.
    response = ask(server, "Pick a word.", n=8, temperature=1.0, seed=5, max_tokens=5)
    assert sorted(c.index for c in response.choices) == list(range(8))
    assert all(c.finish_reason in {"stop", "length"} for c in response.choices)
    assert response.usage.completion_tokens > 0


def test_more_concurrent_requests_than_running_slots_all_answered(server):
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, server, f"Request {i}", max_tokens=6) for i in range(6)]
        responses = [f.result(timeout=120) for f in futures]
    assert all(r.choices[0].finish_reason in {"stop", "length"} for r in responses)


@pytest.mark.parametrize(
    "case",
    ["missing_file", "undecodable", "video_without_fps", "too_long", "unknown_model"],
)
def test_failures_are_4xx_and_the_server_keeps_serving(server, media, case):
    d = media["dir"]
    if case == "missing_file":
        content, status, needle = (
            [{"type": "image_url", "image_url": {"url": str(d / "nope.png")}}],
            400,
            "nope.png",
        )
    elif case == "undecodable":
        bad = d / "bad.mp4"
        bad.write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video")
        content, status, needle = (
            [{"type": "video_url", "video_url": {"url": str(bad)}}],
            400,
            ("bad.mp4"),
        )
    elif case == "video_without_fps":
        from areno.media.samples import write_video_without_frame_rate

        path = write_video_without_frame_rate(d / "nofps.mkv")
        content, status, needle = (
            [{"type": "video_url", "video_url": {"url": str(path)}}],
            400,
            ("frame rate"),
        )
    elif case == "too_long":
        content, status, needle = "word " * (MAX_PROMPT_TOKENS * 2), 400, "--max-prompt-tokens"
    else:
        content, status, needle = "hi", 404, "not served"
    model = "other-model" if case == "unknown_model" else "tiny-gemma4"
    with pytest.raises(openai.APIStatusError) as caught:
        server.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=4
        )
    assert caught.value.status_code == status
    assert needle in caught.value.message
    assert ask(server, "Still there?").choices[0].message.content is not None


def test_tools_reach_the_template_unless_tool_choice_is_none(server, media):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "zoom",
                "description": "Crop and zoom into the image.",
                "parameters": {"type": "object", "properties": {"x": {"type": "number"}}},
            },
        }
    ]
    history = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": media["image"]}},
                {"type": "text", "text": "Zoom in."},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "zoom", "arguments": '{"x": 0.5}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "zoomed"},
    ]

    def prompt_tokens(**kwargs) -> int:
        response = server.chat.completions.create(
            model="tiny-gemma4", messages=history, max_tokens=4, temperature=0, **kwargs
        )
        assert response.choices[0].finish_reason in {"stop", "length", "tool_calls"}
        return response.usage.prompt_tokens

    without = prompt_tokens()
    assert prompt_tokens(tools=tools, tool_choice="auto") > without
    assert prompt_tokens(tools=tools, tool_choice="none") == without


def completion_log(response_id: str) -> dict:
    """The ARENO_LOG_COMPLETIONS record of a response, read from the Ingress replica's log."""
    import glob
    import json
    import time

    session = ray._private.worker._global_node.get_session_dir_path()
    for _ in range(50):
        logs = "".join(
            Path(p).read_text(errors="replace")
            for p in glob.glob(f"{session}/logs/serve/replica_areno_Ingress_*.log")
        )
        if response_id in logs:
            break
        time.sleep(0.2)
    line = next(x for x in logs.splitlines() if response_id in x)
    record, _ = json.JSONDecoder().raw_decode(line, line.index("completion {") + len("completion "))
    return record


def test_completions_are_logged_with_areno_log_completions(server):
    """The record carries digests of the caller's `user` and `metadata` (their only effect:
    AReno stores no completions), so a client can find its completions; never the values."""
    from areno.serve.metrics import caller_digests

    response = ask(server, "Log me.", user="alice", metadata={"run": "r1"})
    record = completion_log(response.id)
    assert record["prompt_tokens"] == response.usage.prompt_tokens
    assert {"finish_reason", "tool_calls"} <= set(record["choices"][0])
    digests = caller_digests("alice", {"run": "r1"})
    assert record["user_digest"] == digests["user_digest"]
    assert record["metadata_digest"] == digests["metadata_digest"]
    assert "alice" not in json.dumps(record) and "r1" not in json.dumps(record)
    assert "user_digest" not in completion_log(ask(server, "Log me too.").id)


@pytest.fixture(scope="module")
def http_media(media):
    """A loopback HTTP server over the test's media directory."""
    directory = str(media["dir"])

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=directory, **kwargs)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


def guarded_client(server, key: str | None = API_KEY) -> openai.OpenAI:
    base = str(server.base_url).rstrip("/").removesuffix("/v1")
    return openai.OpenAI(base_url=f"{base}/guarded/v1", api_key=key or "wrong", max_retries=0)


def test_remote_media_fetched_when_allowed(server, http_media):
    url = f"{http_media}/a.png"
    response = ask(server, [{"type": "image_url", "image_url": {"url": url}}])
    assert response.usage.prompt_tokens_details.image_tokens > 0


def _routes(routes):
    """The app's routes, through the routers Serve's ingress includes them with."""
    for route in routes:
        if hasattr(route, "original_router"):
            yield from _routes(route.original_router.routes)
        elif hasattr(route, "methods"):
            yield route


def test_api_key_is_required_on_every_route_but_health(server):
    import httpx2

    from areno.serve.ingress import api

    base = str(guarded_client(server).base_url).rstrip("/")
    with pytest.raises(openai.AuthenticationError):
        guarded_client(server, key="wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        ask(guarded_client(server, key="wrong"), "hi")
    # Every route the app defines (so a new one is covered too): no key, a wrong one, the key
    # without "Bearer" or in another scheme.
    app_base = base.removesuffix("/v1")
    routes = [(m, r.path) for r in _routes(api.routes) for m in r.methods if m != "HEAD"]
    expected = {("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions")}
    assert expected | {("POST", "/v1/completions")} <= set(routes)
    for method, path in routes:
        for auth in (None, "Bearer wrong", API_KEY, f"Basic {API_KEY}", f"Bearer {API_KEY}x"):
            headers = {"Authorization": auth} if auth else {}
            response = httpx2.request(method, app_base + path, headers=headers, json={}, timeout=60)
            if path == "/health":
                assert response.status_code == 200
                continue
            assert response.status_code == 401, (method, path, auth)
            assert response.json()["error"]["code"] == "invalid_api_key"
    # FastAPI's schema and docs pages are not served: they would answer without the key.
    for path in ("/openapi.json", "/docs", "/redoc"):
        response = httpx2.get(app_base + path, timeout=60)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert [m.id for m in guarded_client(server).models.list().data] == ["tiny-gemma4"]


def test_health_says_starting_until_the_engine_is_up(server, tiny_path):
    """The Ingress answers HTTP as soon as its replica runs; `/health` must not say "ok" while
    the Generator is still starting. Here it can never start (it needs a resource no node has),
    so its app stays deploying while the Ingress answers."""
    import time

    import httpx2
    from ray import serve

    base = str(server.base_url).rstrip("/").removesuffix("/v1")
    config = ServeConfig(
        model_path=str(tiny_path("gemma4")),
        engine=EngineConfig(max_running_prompts=1, max_context_len=256),
        num_cpus_per_deployment=0.05,  # the test instance's 4 CPUs are mostly taken
        deployment_resources={"generator": {"areno_test_absent": 1}},
    )
    target = serve.RunTarget(build_app(config), name="starting", route_prefix="/starting")
    serve.run_many([target], wait_for_applications_running=False)

    def health():
        """The new app's /health; None while its Ingress replica is still starting (a loaded
        machine can keep the first answer longer than a read timeout)."""
        try:
            return httpx2.get(f"{base}/starting/health", timeout=30)
        except httpx2.TimeoutException:
            return None

    try:
        deadline = time.monotonic() + 240
        response = health()
        while (response is None or response.status_code != 503) and time.monotonic() < deadline:
            time.sleep(0.5)  # 404 from the root app until this app's route exists
            response = health()
        assert response is not None and response.status_code == 503, response
        assert response.json()["status"] == "starting"
        assert "still starting" in response.json()["detail"]
        assert httpx2.get(f"{base}/health", timeout=30).json() == {"status": "ok"}
    finally:
        serve.delete("starting")


def test_guarded_server_refuses_media_outside_its_roots_and_remote_urls(
    server, media, media_root, http_media
):
    client = guarded_client(server)
    inside = write_image(media_root / "ok.png", 32, 32)
    assert ask(client, [{"type": "image_url", "image_url": {"url": str(inside)}}]).choices
    refused = {
        media["image"]: "allowed",
        f"{http_media}/a.png": "remote",
    }
    for url, needle in refused.items():
        with pytest.raises(openai.APIStatusError) as caught:
            ask(client, [{"type": "image_url", "image_url": {"url": url}}])
        assert 400 <= caught.value.status_code < 500
        assert needle in caught.value.message.lower(), caught.value.message


ZOOM = {
    "type": "function",
    "function": {
        "name": "zoom",
        "description": "Crop and zoom into the image.",
        "parameters": {"type": "object", "properties": {"x": {"type": "number"}}},
    },
}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path("gemma4"))


def _tool_ask(client, tool_choice, **kwargs):
    return ask(client, "Zoom in.", tools=[NOTE, ZOOM], tool_choice=tool_choice, **kwargs)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice_forces_the_call_opening(server, tokenizer, choice):
    """The forced opening: the prompt carries it (prompt_tokens grow by its tokens) and the reply
    is parsed after it; cut at 4 tokens, before the grammar lets the call end, the unfinished
    call comes back as content that starts with it (naming the function for a named choice),
    counted as malformed. (Whole calls: test_a_strict_tool_call_validates_against_its_schema.)"""
    from areno.tools import get_tool_parser

    named = {"type": "function", "function": {"name": "zoom"}}
    prefix = get_tool_parser("gemma4").forced_prefix("zoom" if choice == "named" else None)
    auto = _tool_ask(server, "auto", max_tokens=4)
    forced = _tool_ask(server, named if choice == "named" else "required", max_tokens=4)
    num_prefix_tokens = len(tokenizer.encode(prefix, add_special_tokens=False))
    assert forced.usage.prompt_tokens == auto.usage.prompt_tokens + num_prefix_tokens

    [answer] = forced.choices
    assert answer.message.content.startswith(prefix)
    assert not answer.message.tool_calls
    assert answer.finish_reason in {"stop", "length"}  # never "tool_calls" without a call
    assert completion_log(forced.id)["malformed_tool_calls"] == 1


def test_named_tool_choice_streams_what_the_unary_reply_holds(server):
    named = {"type": "function", "function": {"name": "zoom"}}
    full = _tool_ask(server, named, max_tokens=6)
    stream = _tool_ask(server, named, max_tokens=6, stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert content == full.choices[0].message.content
    assert content.startswith("<|tool_call>call:zoom")
    assert calls == [] and finish == full.choices[0].finish_reason


def test_named_tool_choice_outside_tools_is_400(server):
    with pytest.raises(openai.BadRequestError) as caught:
        _tool_ask(server, {"type": "function", "function": {"name": "pan"}})
    assert "'pan'" in caught.value.message and "zoom" in caught.value.message


def test_overload_is_refused_with_429_and_the_server_keeps_serving(server):
    """More concurrent requests than the guarded app's 2 slots + 1 waiting place: each is
    answered or refused at once with 429 and Retry-After, never left hanging."""
    client = guarded_client(server)  # max_retries=0: a 429 reaches the test

    def call(i: int):
        try:
            return ask(client, f"Long answer {i}", max_tokens=256, extra_body={"ignore_eos": True})
        except openai.RateLimitError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        results = list(pool.map(call, range(10), timeout=300))
    answered = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert answered and refused
    assert all(r.choices[0].finish_reason == "length" for r in answered)
    for error in refused:
        assert error.status_code == 429
        assert "--max-queued-requests" in error.message
        assert error.code == "rate_limit_exceeded"
        assert int(error.response.headers["retry-after"]) >= 1
    assert ask(client, "Fresh request after the burst.").choices[0].finish_reason


STRICT_PAN = {
    "type": "function",
    "function": {
        "name": "pan",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "direction": {"enum": ["left", "right"]},
                "steps": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["direction", "steps"],
            "additionalProperties": False,
        },
    },
}


def test_a_json_schema_reply_validates_against_the_schema(server):
    """Random weights: only the grammar makes these replies parse."""

    format_ = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    response = ask(server, "Name a pet.", response_format=format_, n=2, temperature=1.0, seed=2,
                   max_tokens=48)  # fmt: skip
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)
        assert choice.finish_reason == "stop"


def test_a_strict_tool_call_validates_against_its_schema(server):

    response = ask(server, "Pan.", tools=[STRICT_PAN], tool_choice="required", max_tokens=64)
    [choice] = response.choices
    [call] = choice.message.tool_calls
    assert call.function.name == "pan" and choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), STRICT_PAN["function"]["parameters"])


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


# ---- /v1/completions ----------------------------------------------------------------------


def complete(client, prompt, **kwargs):
    return client.completions.create(
        model=kwargs.pop("model", "tiny-gemma4"),
        prompt=prompt,
        max_tokens=kwargs.pop("max_tokens", 6),
        temperature=kwargs.pop("temperature", 0),
        **kwargs,
    )


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


def test_echo_with_a_generated_token_and_an_adapter(server, tokenizer):
    """The other loglikelihood form (max_tokens 1): the prompt's logprobs, then the sampled
    token's; a LoRA adapter named in `model` scores and generates as that adapter."""
    ids = tokenizer("A small test")["input_ids"]
    base, adapted = (
        complete(server, [ids], echo=True, logprobs=1, max_tokens=1, model=model)
        for model in ("tiny-gemma4", "tiny-lora")
    )
    for response in (base, adapted):
        logprobs = response.choices[0].logprobs
        assert len(logprobs.token_logprobs) == len(ids) + 1
        assert response.choices[0].text.startswith(tokenizer.decode(ids))
        assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])
    assert adapted.model == "tiny-lora"
    assert adapted.choices[0].logprobs.token_logprobs != base.choices[0].logprobs.token_logprobs


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


def _time_per_100_tokens(client) -> float:
    """Seconds the guarded app takes for 100 tokens of its 2 running rows, overheads included."""
    import time

    started = time.monotonic()
    complete(client, ["Two", "rows"], max_tokens=100, extra_body={"ignore_eos": True})
    return time.monotonic() - started


def _wait_until_idle(app: str, timeout_s: float) -> dict:
    """The app's engine stats once nothing runs or waits there, or at the timeout."""
    import time

    generator = serve.get_deployment_handle("GeneratorServer", app)
    deadline = time.monotonic() + timeout_s
    while (stats := generator.stats.remote().result())["num_running"] + stats["num_waiting"]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return stats


LONG = {"max_tokens": 1500, "extra_body": {"ignore_eos": True}}


def test_a_refused_prompt_of_a_batch_fails_it_and_stops_the_others(server):
    """The guarded app runs 2 sequences and lets 1 wait: of 5 prompts, the fourth is refused
    (429), and the request's other prompts, each its own engine request, are aborted rather
    than left generating 1500 tokens each (15 times the time allowed here)."""
    client = guarded_client(server)
    time_per_100 = _time_per_100_tokens(client)
    with pytest.raises(openai.RateLimitError) as caught:
        complete(client, ["Long"] * 5, **LONG)
    assert "--max-queued-requests" in caught.value.message
    stats = _wait_until_idle("guarded", 3 * time_per_100)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert complete(client, ["Fresh", "batch"], max_tokens=3).usage.completion_tokens > 0


def test_a_streamed_batch_stops_when_its_client_leaves(server):
    client = guarded_client(server)
    time_per_100 = _time_per_100_tokens(client)
    stream = complete(client, ["Long", "longer"], stream=True, **LONG)
    assert next(iter(stream)).object == "text_completion"
    stream.close()
    stats = _wait_until_idle("guarded", 3 * time_per_100)
    assert stats["num_running"] == stats["num_waiting"] == 0
