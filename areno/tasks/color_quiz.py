"""Color quiz: an image filled with one color (plus noise); the answer is the color's letter.

The question lists the colors as lettered options ("A red, B green, ..."); the expected reply is
the letter (the color's name also counts). A letter is one token in every tokenizer, which keeps
the tiny demo's credit assignment simple: one answer token, then the end of the turn.

The answer depends only on the image, so a policy can only beat chance by looking at it. Each
sample's private metadata holds the answer and a `warmup_answer` drawn independently of the
image: a supervised warm-start on it teaches the answer format (one color word) without the
image -> color mapping, which GRPO must then learn.

    areno train                                   # this task on the embedded tiny checkpoint
    areno sft --target-key warmup_answer ...      # the format-only warm-start
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

from areno.data import Sample
from areno.data.guard import PUBLIC_VALUES
from areno.rollout.trajectory import Trajectory

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 200, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 225, 40),
}
LETTERS = "ABCDEFGH"
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


def question(names: list[str]) -> str:
    options = ", ".join(f"{letter} {name}" for letter, name in zip(LETTERS, names, strict=False))
    return f"Which color fills this image? Options: {options}. Reply with the letter only."


def load(
    split: str = "train",
    num_samples: int = 64,
    seed: int = 0,
    media_dir: str | os.PathLike | None = None,
    colors: list[str] | None = None,
) -> Iterator[Sample]:
    """Samples of `split` (train / validation / test), deterministic by seed, with balanced
    classes; images are written once as PNG files under `media_dir`, referenced by local path.
    Private metadata: `answer` (the letter), `color`, and `warmup_answer` (a random letter)."""
    names = list(colors or COLORS)
    unknown = sorted(set(names) - set(COLORS))
    if unknown or len(names) > len(LETTERS):
        raise ValueError(f"colors must be up to {len(LETTERS)} of {sorted(COLORS)}; got {names}")
    split_seed = seed * 1000 + SPLIT_SEEDS.get(split, 3)
    rng = random.Random(split_seed)
    pixel_rng = np.random.default_rng(split_seed)
    directory = _media_dir(media_dir, seed)
    directory.mkdir(parents=True, exist_ok=True)
    # Stratified: every run of len(names) samples holds each color once (in a random order),
    # so a batch of a multiple of len(names) consecutive samples is balanced. With
    # `data.shuffle: false` GRPO batches then push no color up as a whole, only per image.
    order = []
    while len(order) < num_samples:
        block = list(range(len(names)))
        rng.shuffle(block)
        order += block
    order = order[:num_samples]
    for index, option in enumerate(order):
        color = names[option]
        # NOTE: the name says nothing of the color (the policy reads it): a digest of what
        # decides the image keeps files of other seeds, splits and color lists apart.
        key = f"{seed}|{split}|{','.join(names)}|{index}".encode()
        path = directory / f"{split}-{index:05d}-{hashlib.sha256(key).hexdigest()[:10]}.png"
        _write_image(path, COLORS[color], pixel_rng)
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": str(path)}},
                    {"type": "text", "text": question(names)},
                ],
            }
        ]
        private = {
            "answer": LETTERS[option],
            "color": color,
            "options": {LETTERS[i]: name for i, name in enumerate(names)},
            "warmup_answer": LETTERS[rng.randrange(len(names))],
            # the question lists every option and its letter
            PUBLIC_VALUES: list(names) + [LETTERS[i] for i in range(len(names))],
        }
        yield Sample(messages=messages, private=private, id=f"color_quiz-{split}-{index}")


def chosen_options(text: str, options: dict[str, str]) -> set[str]:
    """The options a reply names, by letter (a word of its own) or by color name."""
    # NOTE: not normalize_text: it drops the article "a", which is also option A.
    words = re.findall(r"[a-z0-9]+", text.casefold())
    names = {name: letter for letter, name in options.items()}
    letters = {letter.lower(): letter for letter in options}
    return {letters.get(w) or names.get(w) for w in words if w in letters or w in names}


def reward(trajectory: Trajectory, private: dict) -> dict[str, float]:
    """accuracy 1 when the reply names exactly the right option (naming several, or none,
    scores 0, so listing every option is not a way to win)."""
    named = chosen_options(trajectory.final_text, private["options"])
    return {"accuracy": float(named == {private["answer"]})}
