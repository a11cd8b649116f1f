"""Generate the two-image comparison dataset: which image holds more objects of one kind?

Each sample holds two images with different numbers (1-6) of the asked kind (a shape of any
color, e.g. "circles") among distractor shapes. The answer is "first" or "second" (balanced);
`private` holds it and both counts.

    python examples/vl/compare/generate_dataset.py --out data/vl_compare
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from areno.data import Sample
from areno.data.guard import PUBLIC_VALUES
from examples.vl.common import COLORS, SHAPES, scene, write_split

SPLIT_SEEDS = {"train": 0, "validation": 1}


def question(shape: str) -> str:
    return (
        f"Which image has more {shape}s, the first or the second? Use side_by_side() or "
        "crop(image, x0, y0, x1, y1) to look closer, then call submit_answer(choice) with "
        "'first' or 'second'."
    )


def _image(rng: np.random.Generator, shape: str, count: int, size: int):
    others = [s for s in SHAPES if s != shape]
    objects = [(str(rng.choice(list(COLORS))), shape) for _ in range(count)]
    objects += [(str(rng.choice(list(COLORS))), str(rng.choice(others)))
                for _ in range(int(rng.integers(1, 5)))]  # fmt: skip
    order = rng.permutation(len(objects))
    image, _ = scene(rng, size, [objects[i] for i in order], side=size // 10)
    return image


def make_sample(rng: np.random.Generator, index: int, split: str, media: Path, size: int) -> Sample:
    shape = str(rng.choice(SHAPES))
    low, high = sorted(int(c) for c in rng.choice(np.arange(1, 7), size=2, replace=False))
    answer = "first" if index % 2 == 0 else "second"
    counts = (high, low) if answer == "first" else (low, high)
    content = []
    for k, count in enumerate(counts):
        path = media / f"{split}-{index:05d}-image{k}.png"
        _image(rng, shape, count, size).save(path)
        content.append({"type": "image_url", "image_url": {"url": str(path.resolve())}})
    content.append({"type": "text", "text": question(shape)})
    # The question names the shape and both choices.
    private = {
        "answer": answer,
        "counts": list(counts),
        "shape": shape,
        PUBLIC_VALUES: ["first", "second", shape],
    }
    return Sample(
        [{"role": "user", "content": content}], private=private, id=f"{split}-{index:05d}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--num-train", type=int, default=128)
    parser.add_argument("--num-validation", type=int, default=32)
    parser.add_argument("--size", type=int, default=96, help="image width and height")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    media = args.out / "media"
    media.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", args.num_train), ("validation", args.num_validation)):
        rng = np.random.default_rng([args.seed, SPLIT_SEEDS[split]])
        samples = [
            make_sample(rng, i, split, media, args.size)
            for i in tqdm(range(count), desc=split, disable=args.no_progress)
        ]
        print(f"wrote {count} samples to {write_split(args.out, split, samples)}")


if __name__ == "__main__":
    main()
