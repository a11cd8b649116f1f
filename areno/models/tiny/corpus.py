"""A small synthetic training corpus for the tiny checkpoints' tokenizers.

The tokenizers are byte-level (or byte-fallback), so any text round-trips; the corpus only
decides which merges exist, so it covers chat prose, numbers and tool-call JSON.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

_WORDS = """
the a an of to in on at for with from by about into over under between after before during
is are was were be been has have had do does did can could will would should may might must
what which who where when why how this that these those there here it its they them their
you your we our he she his her i me my not no yes and or but if then so because while
image picture photo frame video clip audio sound voice music speech noise event scene time
second seconds minute start end segment first last left right top bottom center middle
red green blue yellow white black gray orange purple brown color shape circle square line
dog cat bird car train plane boat person people child man woman crowd street room kitchen
guitar piano drum violin bell siren engine horn bark meow chirp rain wind thunder water
count number one two three four five six seven eight nine ten many few more less
describe answer question tool call function result name arguments value query search
crop zoom inspect submit label range location object objects detected visible heard seen
""".split()

_TOOL_NAMES = ["inspect_range", "crop_image", "submit_answer", "get_weather", "count_objects"]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", "?", "!", ":"])


def _tool_json(rng: random.Random) -> str:
    args = {"start": round(rng.uniform(0, 10), 1), "end": round(rng.uniform(0, 10), 1)}
    if rng.random() < 0.5:
        args = {"label": rng.choice(_WORDS), "x": rng.randint(0, 640), "y": rng.randint(0, 480)}
    return json.dumps({"name": rng.choice(_TOOL_NAMES), "arguments": args})


def corpus(num_lines: int = 3000, seed: int = 0) -> Iterator[str]:
    """Deterministic lines of prose, numbers, JSON and a little unicode."""
    rng = random.Random(seed)
    for i in range(num_lines):
        kind = i % 5
        if kind == 3:
            yield _tool_json(rng)
        elif kind == 4:
            yield f"{rng.randint(0, 99999)} {rng.uniform(-1, 1):.3f} 00:{rng.randint(0, 59):02d} ü é 中文"
        else:
            yield _sentence(rng)
