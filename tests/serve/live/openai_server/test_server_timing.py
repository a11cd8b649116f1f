"""The Server-Timing header on the open Gemma 4 app, read through the official client's raw
response: every hop of a text and an image request, parts within the hops that hold them, and a
stream's header with what is known before its first byte; and the first request of each kind,
which the Ingress sent itself before it said it was ready."""

from __future__ import annotations

import time

import httpx

from areno.serve.timing import parse_header
from tests.serve.live.openai_server.client import ingress_log

# Entries are rounded to a microsecond each; sums allow for it.
SLACK_MS = 0.01


def _raw(server, content, **kwargs):
    raw = server.chat.completions.with_raw_response.create(
        model="tiny-gemma4",
        messages=[{"role": "user", "content": content}],
        max_tokens=6,
        temperature=0,
        **kwargs,
    )
    return raw, parse_header(raw.headers["server-timing"])


def _laps_fill_the_total(timing: dict[str, float], laps: list[str]) -> None:
    assert all(timing[name] >= 0 for name in timing)
    assert sum(timing[name] for name in laps) <= timing["total"] + SLACK_MS * len(laps)
    # What no lap covers is the header's own building: a fraction of a millisecond.
    assert timing["total"] - sum(timing[name] for name in laps) < 5


def test_a_text_request_reports_every_hop(server):
    raw, timing = _raw(server, "Time this, please.")
    assert raw.parse().choices[0].message.content is not None
    laps = ["read", "parse", "encode", "generate", "reply"]
    assert set(timing) == {*laps, "engine-queue", "engine-prefill", "engine-decode", "total"}
    _laps_fill_the_total(timing, laps)
    engine = timing["engine-queue"] + timing["engine-prefill"] + timing["engine-decode"]
    assert 0 < engine <= timing["generate"] + SLACK_MS


def test_an_image_request_reports_its_media_hops(server, media):
    content = [
        {"type": "image_url", "image_url": {"url": media["image"]}},
        {"type": "text", "text": "What is it?"},
    ]
    raw, timing = _raw(server, content)
    assert raw.parse().usage.prompt_tokens_details.image_tokens > 0
    laps = ["read", "parse", "prompt", "generate", "reply"]
    assert "encode" not in timing  # a prompt with media is encoded by the Processor replica
    _laps_fill_the_total(timing, laps)
    assert timing["media-decode"] > 0 and timing["media-process"] > 0
    assert timing["media-decode"] + timing["media-process"] <= timing["prompt"] + SLACK_MS


def test_a_stream_reports_the_hops_before_its_first_byte(server):
    raw, timing = _raw(server, "Stream this.", stream=True)
    chunks = list(raw.parse())
    assert chunks and chunks[-1].choices[0].finish_reason is not None
    laps = ["read", "parse", "encode", "first-token"]
    assert set(timing) == {*laps, "total"}
    _laps_fill_the_total(timing, laps)


def test_the_ingress_sent_the_first_request_of_each_kind_before_serving(server):
    base = str(server.base_url).rstrip("/").removesuffix("/v1")
    deadline = time.monotonic() + 120
    while httpx.get(f"{base}/health").status_code != 200:  # 503 until they are sent
        assert time.monotonic() < deadline, "/health never answered 200"
        time.sleep(0.2)
    sent = "sent the first request of each kind before serving: text, audio, image, video"
    logs = ingress_log(sent)
    assert sent in logs
    assert "before serving failed" not in logs
