"""The AVE agent: look at and listen to time ranges of the clip, then submit label + segment.

Tools (they read the clip from the sample's public messages, `ctx.media_urls("video")`):
- `view_frames(start_s, end_s)`: up to `max_frames` frames of the range, as images;
- `listen(start_s, end_s)`: the range's audio, as a WAV clip;
- `submit_answer(label, start_s, end_s)`: the final answer; ends the episode.

A bad call (missing argument, a range outside the clip) raises ToolError: its message goes back
to the model as the tool's result, so it can retry.
"""

from __future__ import annotations

import math
from typing import Any

from areno.rollout.agent import Agent, ToolContext, ToolError
from examples.multimodal.ave_event_recognition import clip
from examples.multimodal.ave_event_recognition.events import EVENT_BY_NAME

MAX_LISTEN_S = 5.0
SYSTEM_PROMPT = (
    "You recognise audio-visual events in video clips. Use view_frames and listen to inspect "
    "parts of the clip, then call submit_answer once with the event label and its start and end "
    "time in seconds."
)


def _range_schema(name: str, description: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    "start_s": {"type": "number", "description": "start time in seconds"},
                    "end_s": {"type": "number", "description": "end time in seconds"},
                },
                "required": ["start_s", "end_s"],
            },
        },
    }


TOOL_SCHEMAS = [
    _range_schema("view_frames", "Frames sampled from the clip between start_s and end_s."),
    _range_schema("listen", "The clip's audio between start_s and end_s."),
    {
        "type": "function",
        "function": {
            "name": "submit_answer",
            "description": "Submit the event label and the segment where it happens.",
            "parameters": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "enum": sorted(EVENT_BY_NAME)},
                    "start_s": {"type": "number"},
                    "end_s": {"type": "number"},
                },
                "required": ["label", "start_s", "end_s"],
            },
        },
    },
]


def number(arguments: dict, name: str) -> float:
    """A finite number argument, or ToolError saying what was wrong."""
    if name not in arguments:
        raise ToolError(f"missing argument {name!r}")
    value = arguments[name]
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ToolError(f"{name} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ToolError(f"{name} must be a number of seconds, got {value!r}")
    return float(value)


def clip_range(arguments: dict, ctx: ToolContext) -> tuple[clip.ClipInfo, float, float]:
    """The sample's clip and a checked [start_s, end_s) inside it."""
    start, end = number(arguments, "start_s"), number(arguments, "end_s")
    urls = ctx.media_urls("video")
    if not urls:
        raise ToolError("this sample has no video clip to inspect")
    info = clip.probe(urls[0])
    if not 0 <= start < end <= info.duration_s + 1e-3:
        raise ToolError(
            f"bad range [{start:g}, {end:g}): need 0 <= start_s < end_s <= "
            f"{info.duration_s:g} (the clip's length in seconds)"
        )
    return info, start, min(end, info.duration_s)


def make_view_frames(max_frames: int):
    def view_frames(arguments: dict, ctx: ToolContext) -> list[dict]:
        info, start, end = clip_range(arguments, ctx)
        frames = clip.frames_in(info, start, end, max_frames)
        if not frames:
            raise ToolError(f"no frame lies in [{start:g}, {end:g}); try a longer range")
        times = ", ".join(f"{t:.2f}" for t, _ in frames)
        parts: list[dict] = [{"type": "text", "text": f"frames at t = {times} s"}]
        parts += [{"type": "image_url", "image_url": {"url": str(path)}} for _, path in frames]
        return parts

    return view_frames


def listen(arguments: dict, ctx: ToolContext) -> list[dict]:
    info, start, end = clip_range(arguments, ctx)
    if not info.has_audio:
        raise ToolError("this clip has no audio track")
    if end - start > MAX_LISTEN_S:
        raise ToolError(f"listen to at most {MAX_LISTEN_S:g} s at a time, got {end - start:g} s")
    path, seconds = clip.audio_range(info, start, end)
    return [
        {"type": "text", "text": f"audio from {start:g} s to {start + seconds:g} s"},
        {"type": "audio_url", "audio_url": {"url": str(path)}},
    ]


def submit_answer(arguments: dict, ctx: ToolContext) -> str:
    # The reward reads the call's arguments itself; this only tells the model what was wrong.
    label = arguments.get("label")
    if not isinstance(label, str) or not label.strip():
        raise ToolError("label must be a non-empty string")
    start, end = number(arguments, "start_s"), number(arguments, "end_s")
    if end < start:
        raise ToolError(f"end_s ({end:g}) is before start_s ({start:g})")
    return "answer recorded"


def ave_agent(max_turns: int = 4, max_frames: int = 4, **_: Any) -> Agent:
    """The AVE agent (`rollout.agent: examples.multimodal.ave_event_recognition.agent:ave_agent`)."""
    return Agent(
        tools={
            "view_frames": make_view_frames(max_frames),
            "listen": listen,
            "submit_answer": submit_answer,
        },
        tool_schemas=TOOL_SCHEMAS,
        system_prompt=SYSTEM_PROMPT,
        max_turns=max_turns,
        final_tools=("submit_answer",),
    )
