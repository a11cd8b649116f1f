"""Color quiz: an image filled with one color (plus noise); the answer is the color's name.

The answer depends only on the image, so a policy can only beat chance by looking at it. Each
sample's private metadata holds the answer and a `warmup_answer` drawn independently of the
image: a supervised warm-start on it teaches the answer format (one color word) without the
image -> color mapping, which GRPO must then learn.

    areno train                                   # this task on the embedded tiny checkpoint
    areno sft --target-key warmup_answer ...      # the format-only warm-start
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

from areno.data import Sample
from areno.rewards import normalize_text
from areno.rollout.trajectory import Trajectory

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 200, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 225, 40),
}
QUESTION = "What color is this image? Answer with one word."
SPLIT_SEEDS = {"train": 0, "validation": 1, "test": 2}


def _media_dir(media_dir: str | os.PathLike | None, seed: int) -> Path:
    if media_dir is not None:
        return Path(media_dir)
    root = os.environ.get("ARENO_CACHE_DIR") or Path.home() / ".cache" / "areno"
    return Path(root) / "tasks" / f"color_quiz-{seed}"


def _write_image(path: Path, rgb: tuple[int, int, int], rng: np.random.Generator) -> None:
    if path.exists():
        return
    noise = rng.integers(-25, 26, size=(32, 32, 3))
    pixels = np.clip(np.array(rgb)[None, None, :] + noise, 0, 255).astype(np.uint8)
    tmp = path.with_suffix(f".tmp{os.getpid()}.png")
    Image.fromarray(pixels).save(tmp)
    tmp.replace(path)


def load(
    split: str = "train",
    num_samples: int = 64,
    seed: int = 0,
    media_dir: str | os.PathLike | None = None,
    colors: list[str] | None = None,
) -> Iterator[Sample]:
    """Samples of `split` (train / validation / test), deterministic by seed; images are
    written once as PNG files under `media_dir` and referenced by local path."""
    names = list(colors or COLORS)
    split_seed = seed * 1000 + SPLIT_SEEDS.get(split, 3)
    rng = random.Random(split_seed)
    pixel_rng = np.random.default_rng(split_seed)
    directory = _media_dir(media_dir, seed)
    directory.mkdir(parents=True, exist_ok=True)
    order = [names[i % len(names)] for i in range(num_samples)]  # balanced classes
    rng.shuffle(order)
    for index, answer in enumerate(order):
        path = directory / f"{split}-{index:05d}-{answer}.png"
        _write_image(path, COLORS[answer], pixel_rng)
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": str(path)}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ]
        private = {"answer": answer, "warmup_answer": rng.choice(names)}
        yield Sample(messages=messages, private=private, id=f"color_quiz-{split}-{index}")


def colors_named(text: str) -> set[str]:
    return {word for word in normalize_text(text).split() if word in COLORS}


def reward(trajectory: Trajectory, private: dict) -> dict[str, float]:
    """accuracy 1 when the answer names exactly the right color (naming several colors, or
    none, scores 0 so that listing every color is not a way to win)."""
    named = colors_named(trajectory.final_text)
    return {"accuracy": float(named == {private["answer"]})}
