"""Load the generated AVE dataset: `<path>/<split>.jsonl`, written by generate_dataset.py."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from areno.data import Sample
from areno.data.loader import jsonl


def load(path: str, split: str = "train", num_samples: int | None = None) -> Iterator[Sample]:
    """The first `num_samples` samples of `split` (all when None)."""
    return itertools.islice(jsonl(path, split), num_samples)
