"""The comparison agent: look at both images side by side or crop one, then choose.

- `side_by_side()`: both images in one, left and right, with a gap between them;
- `crop(image, x0, y0, x1, y1)`: a region of image 1 or 2 (pixel coordinates), enlarged;
- `submit_answer(choice)`: "first" or "second"; ends the episode.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from areno.rollout.agent import Agent, ToolContext, ToolError
from examples.vl.common import int_arg, local_image, tool_output
from examples.vl.counting.agent import make_crop_and_zoom

GAP = 8
SYSTEM_PROMPT = (
    "You compare two images. Use side_by_side or crop to look closer, then call submit_answer "
    "once with 'first' or 'second'."
)
_BOX = {k: {"type": "integer"} for k in ("x0", "y0", "x1", "y1")}
TOOL_SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": "side_by_side",
            "description": "Both images in one picture: the first on the left.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "crop",
            "description": "Crop a box of image 1 or 2 (pixels) and return it enlarged.",
            "parameters": {
                "type": "object",
                "properties": {"image": {"type": "integer", "enum": [1, 2]}, **_BOX},
                "required": ["image", "x0", "y0", "x1", "y1"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit_answer",
            "description": "Submit which image has more of the asked objects.",
            "parameters": {
                "type": "object",
                "properties": {"choice": {"type": "string", "enum": ["first", "second"]}},
                "required": ["choice"],
            },
        },
    },
]


def _two_images(ctx: ToolContext) -> list[str]:
    urls = ctx.media_urls("image")
    if len(urls) != 2:
        raise ToolError(f"this sample has {len(urls)} images; these tools need exactly 2")
    return urls


def side_by_side(arguments: dict, ctx: ToolContext) -> list[dict]:
    if arguments:
        raise ToolError(f"side_by_side takes no arguments, got {sorted(arguments)}")
    urls = _two_images(ctx)
    left, right = (local_image(url) for url in urls)
    height = max(left.height, right.height)
    canvas = Image.new("RGB", (left.width + GAP + right.width, height), (0, 0, 0))
    canvas.paste(left, (0, 0))
    canvas.paste(right, (left.width + GAP, 0))
    path = tool_output(canvas, "|".join(urls))
    return [
        {"type": "text", "text": "first image left, second right"},
        {"type": "image_url", "image_url": {"url": str(path)}},
    ]


def make_crop(zoom: int, max_side: int):
    crop_and_zoom = make_crop_and_zoom(zoom, max_side)

    def crop(arguments: dict, ctx: ToolContext) -> list[dict]:
        index = int_arg(arguments, "image")
        urls = _two_images(ctx)
        if index not in (1, 2):
            raise ToolError(f"image must be 1 or 2, got {index}")
        # the single-image crop tool, pointed at the chosen image
        one = ToolContext(ctx.sample_id, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": urls[index - 1]}}]}], ctx.episode_index)  # fmt: skip
        box = {k: v for k, v in arguments.items() if k != "image"}
        return crop_and_zoom(box, one)

    return crop


def submit_answer(arguments: dict, ctx: ToolContext) -> str:
    choice = arguments.get("choice")
    if not isinstance(choice, str) or not choice.strip():
        raise ToolError("choice must be 'first' or 'second'")
    return "answer recorded"


def compare_agent(max_turns: int = 3, zoom: int = 2, max_side: int = 256, **_: Any) -> Agent:
    """`rollout.agent: examples.vl.compare.agent:compare_agent`."""
    return Agent(
        tools={
            "side_by_side": side_by_side,
            "crop": make_crop(zoom, max_side),
            "submit_answer": submit_answer,
        },
        tool_schemas=TOOL_SCHEMAS,
        system_prompt=SYSTEM_PROMPT,
        max_turns=max_turns,
        final_tools=("submit_answer",),
    )
