"""Chat completions on the open Gemma 4 app: a text reply with its usage, every media source
(local path, data URL, base64 audio, remote URL), streaming against the whole reply, n with
logprobs, more samples and requests than running slots, and errors answered 4xx while the
server keeps serving."""

from __future__ import annotations

import base64
import concurrent.futures

import openai
import pytest

from tests.serve.live.openai_server.client import MAX_PROMPT_TOKENS, ask


def test_text_request_with_usage(server):
    response = ask(server, "Hello there!")
    choice = response.choices[0]
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in {"stop", "length"}
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == (
        response.usage.prompt_tokens + response.usage.completion_tokens
    )
    # No media tokens to report: the details are left out, or carry only the prefix cache's
    # hits where an earlier test sent this prompt too.
    details = response.usage.prompt_tokens_details
    assert details is None or (details.image_tokens, details.audio_tokens) == (None, None)


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


def test_remote_media_fetched_when_allowed(server, http_media):
    url = f"{http_media}/a.png"
    response = ask(server, [{"type": "image_url", "image_url": {"url": url}}])
    assert response.usage.prompt_tokens_details.image_tokens > 0
