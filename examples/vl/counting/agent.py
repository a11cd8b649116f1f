"""The counting agent: zoom into a region of the image, then submit the count.

- `crop_and_zoom(x0, y0, x1, y1)`: the region in the original image's pixel coordinates, cropped
  and enlarged `zoom` times (at most `max_side` pixels a side), returned as an image;
- `submit_answer(count)`: the final answer; ends the episode.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from areno.rollout.agent import Agent, ToolContext, ToolError
from examples.vl.common import int_arg, local_image, tool_output

MIN_SIDE = 4
SYSTEM_PROMPT = (
    "You count objects in images. Zoom into regions with crop_and_zoom, then call submit_answer "
    "once with the count."
)
TOOL_SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": "crop_and_zoom",
            "description": "Crop the box (x0, y0)-(x1, y1), in pixels of the original image, and "
            "return it enlarged.",
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "integer"} for k in ("x0", "y0", "x1", "y1")},
                "required": ["x0", "y0", "x1", "y1"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit_answer",
            "description": "Submit how many objects of the asked kind the image holds.",
            "parameters": {
                "type": "object",
                "properties": {"count": {"type": "integer"}},
                "required": ["count"],
            },
        },
    },
]


def make_crop_and_zoom(zoom: int, max_side: int):
    def crop_and_zoom(arguments: dict, ctx: ToolContext) -> list[dict]:
        x0, y0, x1, y1 = (int_arg(arguments, k) for k in ("x0", "y0", "x1", "y1"))
        urls = ctx.media_urls("image")
        if not urls:
            raise ToolError("this sample has no image to crop")
        image = local_image(urls[0])
        w, h = image.size
        if not (0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h):
            raise ToolError(f"box ({x0}, {y0}, {x1}, {y1}) must satisfy 0 <= x0 < x1 <= {w} and "
                            f"0 <= y0 < y1 <= {h}")  # fmt: skip
        if min(x1 - x0, y1 - y0) < MIN_SIDE:
            raise ToolError(f"box is too small: each side needs at least {MIN_SIDE} pixels")
        scale = min(zoom, max_side / max(x1 - x0, y1 - y0))
        size = (max(1, round((x1 - x0) * scale)), max(1, round((y1 - y0) * scale)))
        crop = image.crop((x0, y0, x1, y1)).resize(size, Image.Resampling.NEAREST)
        path = tool_output(crop, f"{urls[0]}|{x0},{y0},{x1},{y1}|{size}")
        return [
            {"type": "text", "text": f"region ({x0}, {y0})-({x1}, {y1}) at {size[0]}x{size[1]}"},
            {"type": "image_url", "image_url": {"url": str(path)}},
        ]

    return crop_and_zoom


def submit_answer(arguments: dict, ctx: ToolContext) -> str:
    count = int_arg(arguments, "count")
    if count < 0:
        raise ToolError(f"count must be >= 0, got {count}")
    return "answer recorded"


def counting_agent(max_turns: int = 3, zoom: int = 2, max_side: int = 256, **_: Any) -> Agent:
    """`rollout.agent: examples.vl.counting.agent:counting_agent`."""
    return Agent(
        tools={"crop_and_zoom": make_crop_and_zoom(zoom, max_side), "submit_answer": submit_answer},
        tool_schemas=TOOL_SCHEMAS,
        system_prompt=SYSTEM_PROMPT,
        max_turns=max_turns,
        final_tools=("submit_answer",),
    )
