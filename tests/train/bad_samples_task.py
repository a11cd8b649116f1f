"""The color quiz with samples that cannot run, for tests/train/test_bad_samples.py.

`load` yields the color quiz's samples with some broken on purpose: in `missing` the image
names a file that is not there, in `long` the question is padded past any small
`rollout.max_prompt_tokens`. Everything else is the color quiz as it ships.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

from areno.data import Sample
from areno.tasks import color_quiz

PADDING = " Look closely." * 200


def load(
    split: str = "train",
    num_samples: int = 16,
    media_dir: str | None = None,
    missing: list[int] = (),
    long: list[int] = (),
) -> Iterator[Sample]:
    for index, sample in enumerate(
        color_quiz.load(split=split, num_samples=num_samples, media_dir=media_dir)
    ):
        messages = copy.deepcopy(sample.messages)
        image, text = messages[0]["content"]
        if index in missing:
            image["image_url"]["url"] += ".gone.png"
        if index in long:
            text["text"] += PADDING
        yield Sample(messages, sample.tools, sample.private, id=sample.id)
