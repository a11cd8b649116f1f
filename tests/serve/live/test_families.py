"""A live AReno server for each family other than Gemma 4 (tiny Qwen3.5, MiniCPM-V 4.6 and
Qwen3-VL checkpoints), driven by the official `openai` client over loopback HTTP: image and
video from a local path and a data URL, audio refused with 400, streaming, n with logprobs,
usage, real parsed tool calls under every tool_choice, whole and streamed, and Qwen3.5's
reasoning split into `reasoning_content`.

Each family's app is deployed into the Ray instance of tests/serve/live (conftest.py), tested
and deleted in turn.
The tiny checkpoints have random weights and never write a well-formed call, so each family's
app serves a copy warm-started with `areno sft` on one conversation whose reply is a call in
the family's own format, as its chat template renders it: greedy decoding then reproduces it.
A family whose generation prompt opens a reasoning block also learns a text reply that reasons
first (REASONING_PROMPT), so its reasoning split has a known answer.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import openai
import pytest

from areno.engine.config import EngineConfig
from areno.media.samples import write_audio, write_image, write_video
from areno.serve.chat import forced_prompt_text
from areno.serve.config import ServeConfig
from areno.tools import opens_reasoning
from areno.train.sft import SFTConfig, sft
from tests.serve.live.apps import PET_SCHEMA as SCHEMA
from tests.serve.live.apps import deployed
from tests.tools.test_round_trip import render_assistant_turn

FAMILIES = ("qwen3_5", "minicpmv4_6", "qwen3_vl")
VISUAL = ("image", "video")
MIME = {"image": "image/png", "video": "video/mp4", "audio": "audio/wav"}

ZOOM = {
    "type": "function",
    "function": {
        "name": "zoom",
        "description": "Zoom into the image.",
        "parameters": {"type": "object", "properties": {"factor": {"type": "integer"}}},
    },
}
CALL_ARGUMENTS = {"factor": 2}
TOOL_CHOICES = {
    "auto": "auto",
    "required": "required",
    "named": {"type": "function", "function": {"name": "zoom"}},
}
REASONING_PROMPT = "Think first."
REASONING, ANSWER = "Worth a thought.", "Done."
THINKING_FAMILIES = ("qwen3_5",)  # their templates end the generation prompt with `<think>\n`


@dataclass(frozen=True)
class Served:
    family: str
    model: str
    client: openai.OpenAI


def _part(modality: str, url: str) -> dict:
    key = f"{modality}_url"
    return {"type": key, key: {"url": url}}


def _data_url(path: str, modality: str) -> str:
    return f"data:{MIME[modality]};base64," + base64.b64encode(Path(path).read_bytes()).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("families-media")
    return {
        "image": str(write_image(d / "a.png", 64, 48)),
        "video": str(write_video(d / "v.mp4", seconds=2.0, fps=4.0)),
        "audio": str(write_audio(d / "a.wav", seconds=1.0)),
    }


def tool_messages(media: dict[str, str]) -> list[dict]:
    """The one conversation the warm-start learns and the tool tests send."""
    content = [_part("image", media["image"]), {"type": "text", "text": "Zoom in."}]
    return [{"role": "user", "content": content}]


def warm_start(family: str, source: Path, media: dict[str, str], root: Path) -> Path:
    """`areno sft` on one conversation whose reply is a call of ZOOM as the family's chat
    template writes it, after what the server writes before a forced call (Qwen3.5 closes its
    open `<think>` first), so that auto, required and named choices all continue the same text.
    Where the generation prompt opens a reasoning block, a second conversation's reply reasons
    and then answers (REASONING, then ANSWER)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    generation_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Zoom in."}],
        tools=[ZOOM],
        add_generation_prompt=True,
        tokenize=False,
    )
    call = render_assistant_turn(tokenizer, family, "", [("zoom", CALL_ARGUMENTS)])
    reply = forced_prompt_text(generation_prompt, "") + call
    samples = [{"messages": tool_messages(media), "tools": [ZOOM], "private": {"answer": reply}}]
    if opens_reasoning(generation_prompt):
        thought = f"{REASONING}\n</think>\n\n{ANSWER}"
        messages = [{"role": "user", "content": REASONING_PROMPT}]
        samples.append({"messages": messages, "private": {"answer": thought}})
    data = root / "warm_start.jsonl"
    data.write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    config = SFTConfig(
        model_path=str(source),
        out_dir=str(root / "ckpt"),
        loader="jsonl",
        loader_kwargs={"path": str(data)},
        steps=60,
        batch_size=len(samples),
        lr=1e-2,
    )
    return sft(config, log=lambda _: None)


@pytest.fixture(scope="module", params=FAMILIES)
def server(request, serve_port, tiny_path, media, tmp_path_factory):
    """The family's warm-started app under /<family>; deleted before the next family's."""
    family = request.param
    checkpoint = warm_start(
        family, tiny_path(family), media, tmp_path_factory.mktemp(f"warm-{family}")
    )
    config = ServeConfig(
        model_path=str(checkpoint),
        served_model_name=f"tiny-{family}",
        port=serve_port,
        engine=EngineConfig(max_running_prompts=2, max_context_len=1024),
    )
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{serve_port}/{family}/v1",
        api_key="unused",
        max_retries=0,  # a 5xx must fail the test, not be retried into a pass
        timeout=120,
    )
    with deployed((family, f"/{family}", config)):
        yield Served(family, config.model_name, client)


def ask(server: Served, content, **kwargs):
    return server.client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": content}],
        max_tokens=kwargs.pop("max_tokens", 8),
        temperature=kwargs.pop("temperature", 0),
        **kwargs,
    )


def without_cache_hits(usage) -> dict:
    """A usage without the prefix cache's hits, which grow when the same prompt comes again."""
    counts = usage.model_dump()
    for details in ("prompt_tokens_details", "input_tokens_details"):
        (counts.get(details) or {}).pop("cached_tokens", None)
    return counts


def reasoning_of(message) -> str | None:
    """`reasoning_content` (vLLM's field) as the openai client keeps it: an extra field, read as
    an attribute or from `model_extra`."""
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert getattr(message, "reasoning_content", None) == reasoning
    return reasoning


def test_models_lists_the_served_model(server):
    assert [m.id for m in server.client.models.list().data] == [server.model]


@pytest.mark.parametrize("modality", VISUAL)
def test_media_from_a_local_path_and_a_data_url(server, media, modality):
    """The native processor expands the media placeholder into many token slots, by the same
    count whether the bytes come from a worker-side path or a data URL."""
    text = {"type": "text", "text": "Describe it."}
    text_only = ask(server, [text])
    details = text_only.usage.prompt_tokens_details  # no media: left out, or cache hits only
    assert details is None or (details.image_tokens, details.audio_tokens) == (None, None)
    path = media[modality]
    by_source = {}
    for source, url in {"path": path, "data_url": _data_url(path, modality)}.items():
        response = ask(server, [_part(modality, url), text])
        assert response.choices[0].finish_reason in {"stop", "length"}
        usage = response.usage
        media_tokens = usage.prompt_tokens_details.image_tokens  # images and video frames
        assert media_tokens > 1 and usage.prompt_tokens_details.audio_tokens is None
        assert usage.prompt_tokens - text_only.usage.prompt_tokens >= media_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        by_source[source] = (usage.prompt_tokens, media_tokens)
    assert by_source["path"] == by_source["data_url"]


@pytest.mark.parametrize("form", ["audio_url", "input_audio"])
def test_audio_is_refused_with_400_and_the_server_keeps_serving(server, media, form):
    if form == "audio_url":
        part = _part("audio", media["audio"])
    else:
        data = base64.b64encode(Path(media["audio"]).read_bytes()).decode()
        part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server, [part, {"type": "text", "text": "What do you hear?"}])
    assert caught.value.status_code == 400
    assert "audio" in caught.value.message
    assert ask(server, "Still there?").choices[0].finish_reason in {"stop", "length"}


def test_streaming_matches_the_greedy_response(server, media):
    content = [_part("image", media["image"]), {"type": "text", "text": "Describe it."}]
    full = ask(server, content, max_tokens=12)
    stream = ask(
        server, content, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    reasoning, text, finish, usage = "", "", None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += reasoning_of(choice.delta) or ""
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert full.usage.completion_tokens >= 1
    [answer] = full.choices
    expected = (reasoning_of(answer.message) or "", answer.message.content or "")
    assert (reasoning, text, finish) == (*expected, answer.finish_reason)
    assert without_cache_hits(usage) == without_cache_hits(full.usage)


def test_n_samples_with_logprobs_and_usage(server, media):
    content = [_part("video", media["video"]), {"type": "text", "text": "Pick a word."}]
    response = ask(server, content, n=2, temperature=1.0, seed=3, logprobs=True, top_logprobs=2)
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        tokens = choice.logprobs.content
        assert tokens and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
        assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in tokens)
    usage = response.usage
    assert usage.completion_tokens == sum(len(c.logprobs.content) for c in response.choices)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def ask_zoom(server: Served, media, choice: str, **kwargs):
    return server.client.chat.completions.create(
        model=server.model,
        messages=tool_messages(media),
        tools=[ZOOM],
        tool_choice=TOOL_CHOICES[choice],
        max_tokens=64,
        temperature=0,
        **kwargs,
    )


@pytest.mark.parametrize("choice", sorted(TOOL_CHOICES))
def test_the_warm_started_model_makes_a_parsed_tool_call(server, media, choice):
    """The call comes back in message.tool_calls with JSON-string arguments, whether the model
    opens it (auto) or the server forces its opening (required, named)."""
    response = ask_zoom(server, media, choice)
    [answer] = response.choices
    assert answer.finish_reason == "tool_calls", answer.message.content
    [call] = answer.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "zoom"
    assert json.loads(call.function.arguments) == CALL_ARGUMENTS
    # Qwen3.5's own reply first closes the <think> its generation prompt opened (an empty
    # block: no reasoning_content); a forced call has that in the prompt instead.
    assert answer.message.content is None
    assert reasoning_of(answer.message) is None


@pytest.mark.parametrize("choice", sorted(TOOL_CHOICES))
def test_streamed_tool_call_deltas_assemble_into_the_same_call(server, media, choice):
    [full] = ask_zoom(server, media, choice).choices
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in ask_zoom(server, media, choice, stream=True):
        for delta_choice in chunk.choices:
            content += delta_choice.delta.content or ""
            finish = delta_choice.finish_reason or finish
            for delta in delta_choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] += (delta.function and delta.function.name) or ""
                call["arguments"] += (delta.function and delta.function.arguments) or ""
    expected = [(c.function.name, c.function.arguments) for c in full.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == expected
    assert all(c["id"] for c in calls.values())
    assert content == (full.message.content or "")
    assert finish == full.finish_reason == "tool_calls"


def test_reasoning_comes_back_apart_from_the_content(server):
    """Where the generation prompt opens `<think>` (Qwen3.5), what the model writes before
    `</think>` is `reasoning_content` and the rest `content`, with neither tag in it; streamed as
    reasoning deltas, then content deltas. Cut off inside the block, it is all reasoning (and
    its tokens are counted). With enable_thinking=false the prompt closes the block: nothing is
    reasoning. Other families never get reasoning_content."""
    full = ask(server, REASONING_PROMPT, max_tokens=24)
    message = full.choices[0].message
    thinks = server.family in THINKING_FAMILIES
    if thinks:
        assert (reasoning_of(message), message.content) == (REASONING, ANSWER)
    else:
        assert reasoning_of(message) is None
    assert not any(tag in (message.content or "") for tag in ("<think>", "</think>"))

    reasoning, content = "", ""
    for chunk in ask(server, REASONING_PROMPT, max_tokens=24, stream=True):
        for choice in chunk.choices:
            reasoning += reasoning_of(choice.delta) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (reasoning_of(message) or "", message.content or "")

    if thinks:
        cut = ask(server, REASONING_PROMPT, max_tokens=3)
        assert cut.usage.completion_tokens == 3
        [choice] = cut.choices
        assert choice.finish_reason == "length" and choice.message.content is None
        assert REASONING.startswith(reasoning_of(choice.message))

    closed = ask(
        server, REASONING_PROMPT, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert reasoning_of(closed.choices[0].message) is None


def test_a_json_schema_reply_validates_against_the_schema(server):
    """The grammar, not the weights, makes the reply this JSON (reasoning off: a thinking
    family would reason first, and the grammar waits for the reasoning to end)."""
    response = ask(
        server,
        "Name a pet.",
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        max_tokens=48,
    )
    [choice] = response.choices
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.finish_reason == "stop"


def test_the_responses_api_answers_text_an_image_a_stream_and_a_tool_loop(server, media):
    """`POST /v1/responses` on every family through the official client: text and an image
    (its tokens in the usage), the streamed events equal to the whole reply, and the warm-started
    call as a `function_call` item whose `function_call_output` goes back for a second turn."""
    respond = server.client.responses.create
    common = {"model": server.model, "temperature": 0, "max_output_tokens": 8}
    text = respond(input="Describe it.", **common)
    assert text.status in {"completed", "incomplete"} and isinstance(text.output_text, str)
    image = [{"role": "user", "content": [
        {"type": "input_image", "image_url": media["image"], "detail": "auto"},
        {"type": "input_text", "text": "Describe it."}]}]  # fmt: skip
    whole = respond(input=image, **common)
    assert whole.usage.input_tokens > text.usage.input_tokens + 1
    events = list(respond(input=image, stream=True, **common))
    assert events[-1].type == f"response.{whole.status}"  # completed, or incomplete at the limit
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert without_cache_hits(events[-1].response.usage) == without_cache_hits(whole.usage)
    zoom = {"type": "function"} | {k: v for k, v in ZOOM["function"].items()}
    items = [{"role": "user", "content": [
        {"type": "input_image", "image_url": media["image"], "detail": "auto"},
        {"type": "input_text", "text": "Zoom in."}]}]  # fmt: skip
    first = respond(
        input=items, tools=[zoom], tool_choice="required", **{**common, "max_output_tokens": 64}
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "zoom" and json.loads(call.arguments) == CALL_ARGUMENTS
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "zoomed"})
    second = respond(input=items, tools=[zoom], **common)
    assert second.status in {"completed", "incomplete"}
    assert second.usage.input_tokens > first.usage.input_tokens
