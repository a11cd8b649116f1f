"""A live AReno server (Ray Serve, tiny Gemma 4 checkpoint) driven by the official `openai`
client over loopback HTTP: every media source, streaming, n, logprobs, usage, queueing beyond
--max-running-prompts, and errors answered 4xx while the server keeps serving."""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import http.server
import os
import socket
import threading
from pathlib import Path

import openai
import pytest

from areno.engine.config import EngineConfig
from areno.media.samples import write_audio, write_image, write_video
from areno.serve.app import APP_NAME, build_app
from areno.serve.config import ServeConfig

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

MAX_PROMPT_TOKENS = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed-media")


@pytest.fixture(scope="module")
def server(tiny_path, media_root):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["ARENO_LOG_COMPLETIONS"] = "1"  # inherited by the Serve replicas
    port = _free_port()
    config = ServeConfig(
        model_path=str(tiny_path("gemma4")),
        served_model_name="tiny-gemma4",
        port=port,
        engine=EngineConfig(max_running_prompts=2, max_context_len=2048),
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        allow_remote_media=True,
        allow_private_network_media=True,  # the test's HTTP server is on loopback
    )
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        # A second app: an API key, one allowed media root, remote media at its default (off).
        guarded = dataclasses.replace(
            config, api_key=API_KEY, allowed_local_media_paths=(str(media_root),)
        )
        guarded = dataclasses.replace(
            guarded, allow_remote_media=False, allow_private_network_media=False
        )
        serve.run(build_app(guarded), name="guarded", route_prefix="/guarded")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    finally:
        serve.shutdown()
        ray.shutdown()


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
        model="tiny-gemma4",
        messages=[{"role": "user", "content": content}],
        max_tokens=kwargs.pop("max_tokens", 8),
        temperature=kwargs.pop("temperature", 0),
        **kwargs,
    )


def test_models_lists_the_served_model(server):
    models = server.models.list()
    assert [m.id for m in models.data] == ["tiny-gemma4"]


def test_text_request_with_usage(server):
    response = ask(server, "Hello there!")
    choice = response.choices[0]
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in {"stop", "length"}
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == (
        response.usage.prompt_tokens + response.usage.completion_tokens
    )


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


def test_completions_are_logged_with_areno_log_completions(server):
    import glob
    import time

    response = ask(server, "Log me.")
    session = ray._private.worker._global_node.get_session_dir_path()
    for _ in range(50):
        logs = "".join(
            Path(p).read_text(errors="replace")
            for p in glob.glob(f"{session}/logs/serve/replica_areno_Ingress_*.log")
        )
        if response.id in logs:
            break
        time.sleep(0.2)
    line = next(x for x in logs.splitlines() if response.id in x)
    assert '"prompt_tokens"' in line and '"finish_reason"' in line and '"tool_calls"' in line


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


def test_api_key_is_required_on_every_route_but_health(server):
    import httpx2

    base = str(guarded_client(server).base_url).rstrip("/")
    with pytest.raises(openai.AuthenticationError):
        guarded_client(server, key="wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        ask(guarded_client(server, key="wrong"), "hi")
    assert httpx2.get(base.removesuffix("/v1") + "/health").status_code == 200
    assert [m.id for m in guarded_client(server).models.list().data] == ["tiny-gemma4"]


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
