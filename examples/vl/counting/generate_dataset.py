"""Generate the counting dataset: small colored shapes on a noisy image; count one kind.

Each image holds 1-6 objects of the target kind (a color and a shape, e.g. "red circles") among
distractors of other colors and shapes, drawn small so that zooming in helps. The question names
the target; `private` holds the count and the targets' boxes.

    python examples/vl/counting/generate_dataset.py --out data/vl_counting
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
MAX_COUNT = 6


def question(color: str, shape: str, size: int) -> str:
    return (
        f"How many {color} {shape}s are in this {size}x{size} image? Use crop_and_zoom(x0, y0, "
        "x1, y1) (pixel coordinates) to look closer, then call submit_answer(count)."
    )


def make_sample(rng: np.random.Generator, index: int, split: str, media: Path, size: int) -> Sample:
    color, shape = str(rng.choice(list(COLORS))), str(rng.choice(SHAPES))
    count = int(rng.integers(1, MAX_COUNT + 1))
    others = [(c, s) for c in COLORS for s in SHAPES if (c, s) != (color, shape)]
    num_distractors = int(rng.integers(2, 7))
    distractors = [others[i] for i in rng.integers(0, len(others), size=num_distractors)]
    objects = [(color, shape)] * count + distractors
    order = rng.permutation(len(objects))
    image, boxes = scene(rng, size, [objects[i] for i in order], side=size // 12)
    path = media / f"{split}-{index:05d}.png"
    image.save(path)
    targets = [list(boxes[k]) for k, i in enumerate(order) if i < count]
    content = [
        {"type": "image_url", "image_url": {"url": str(path.resolve())}},
        {"type": "text", "text": question(color, shape, size)},
    ]
    private = {  # the question names the target
        "count": count,
        "target": f"{color} {shape}",
        "boxes": targets,
        PUBLIC_VALUES: [f"{color} {shape}"],
    }
    return Sample([{"role": "user", "content": content}], private=private, id=path.stem)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--num-train", type=int, default=128)
    parser.add_argument("--num-validation", type=int, default=32)
    parser.add_argument("--size", type=int, default=128, help="image width and height")
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
