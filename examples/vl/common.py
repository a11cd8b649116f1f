"""What the visual examples share: drawing small shapes, tool-argument checks, the last call of
a tool in a trajectory, and writing a dataset split as JSONL."""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from areno.data import Sample
from areno.rollout.agent import ToolError
from areno.rollout.trajectory import Trajectory

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
    "purple": (150, 60, 190),
}
SHAPES = ("circle", "square", "triangle")


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], rgb) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=rgb)
    elif shape == "square":
        draw.rectangle(box, fill=rgb)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=rgb)


def place(rng: np.random.Generator, size: int, side: int, taken: list) -> tuple[int, int, int, int]:
    """A free `side`-pixel box in a `size` image (not overlapping `taken`), appended to it."""
    for _ in range(200):
        x, y = (int(v) for v in rng.integers(2, size - side - 2, size=2))
        box = (x, y, x + side, y + side)
        if all(x + side + 2 < a or a + side + 2 < x or y + side + 2 < b or b + side + 2 < y
               for a, b, *_ in taken):  # fmt: skip
            taken.append(box)
            return box
    raise ValueError(f"no room for another {side}px object in a {size}px image; use fewer")


def scene(
    rng: np.random.Generator, size: int, objects: Iterable[tuple[str, str]], side: int
) -> tuple[Image.Image, list[tuple[int, int, int, int]]]:
    """An image with one (color, shape) object per item, on a noisy background; their boxes."""
    noise = rng.normal(235, 8, size=(size, size, 3))
    image = Image.fromarray(np.clip(noise, 0, 255).astype(np.uint8))
    draw, taken = ImageDraw.Draw(image), []
    boxes = []
    for color, shape in objects:
        box = place(rng, size, side, taken)
        draw_shape(draw, shape, box, COLORS[color])
        boxes.append(box)
    return image, boxes


def int_arg(arguments: dict, name: str) -> int:
    """An integer argument (an integral float or numeric string is accepted), or ToolError."""
    if name not in arguments:
        raise ToolError(f"missing argument {name!r}")
    value = arguments[name]
    try:
        number = float(value) if isinstance(value, str | int | float) else math.nan
    except ValueError:
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number != int(number):
        raise ToolError(f"{name} must be an integer, got {value!r}")
    return int(number)


def tool_output(image: Image.Image, key: str) -> Path:
    """Save a tool's image once, under a name keyed by its inputs (episodes share it)."""
    root = Path(os.environ.get("ARENO_CACHE_DIR") or tempfile.gettempdir()) / "vl-tools"
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.png"
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        image.save(tmp, format="PNG")
        tmp.replace(path)  # concurrent episodes never read a half-written file
    return path


def local_image(url: str) -> Image.Image:
    """An image part's file (paths only: these examples write their images locally)."""
    path = Path(url.removeprefix("file://"))
    if not path.is_file():
        raise ToolError(f"image {path} is not visible where this tool runs")
    with Image.open(path) as image:
        return image.convert("RGB")


def submission(trajectory: Trajectory, tool: str = "submit_answer") -> dict | None:
    """The arguments of the last `tool` call when they parse as a JSON object, else None."""
    calls = [call for call in trajectory.tool_calls if call.name == tool]
    if not calls:
        return None
    try:
        arguments = json.loads(calls[-1].arguments or "{}")
    except json.JSONDecodeError:
        return None
    return arguments if isinstance(arguments, dict) else None


def write_split(out: Path, split: str, samples: Iterable[Sample]) -> Path:
    file = out / f"{split}.jsonl"
    lines = [sample.to_json() for sample in samples]
    file.write_text("\n".join(lines) + "\n")
    return file
