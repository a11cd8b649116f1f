"""The README's fenced commands, as the README check runs them. Every fenced bash or python block
of README.md carries a marker on the line above it, `<!-- check: KIND NAME -->`:
- `run NAME`: tests/test_readme.py runs it as written (on tiny checkpoints);
- `test NAME`: the test registered for NAME in `TESTED_BY` runs it (it reads the block from here);
- `ci NAME`: it is what `.ci/run` runs.
So no command in the README goes unrun, and a changed command changes what the tests run."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# NAME of a `test` block -> the test that runs it
TESTED_BY = {
    "demo": "tests/serve/test_demo_output.py",
    "color_quiz": "tests/train/test_grpo_run.py::test_grpo_learns_the_color_quiz",
    "lora": "tests/train/test_grpo_run.py::test_lora_grpo_learns_the_color_quiz",
}
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
_MARKER = re.compile(r"<!-- check: (run|test|ci) (\w+) -->\n$")


@dataclass(frozen=True)
class Block:
    kind: str | None  # run | test | ci, None when unmarked
    name: str | None
    lang: str
    text: str
    line: int

    def command(self) -> str:
        """The block as bash runs it in the test's environment: the README's `.venv/bin/` is the
        venv running the tests, and its console scripts import this checkout's code."""
        path = f'export PYTHONPATH="{REPO}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        return path + self.text.replace(".venv/bin/", f"{VENV_BIN}/")


def blocks(path: Path = REPO / "README.md") -> list[Block]:
    text = path.read_text()
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()]
        marker = _MARKER.search(before[-80:])
        kind, name = marker.groups() if marker else (None, None)
        line = before.count("\n") + 1
        found.append(Block(kind, name, match.group(1), match.group(2), line))
    return found


def block(name: str) -> Block:
    (found,) = [b for b in blocks() if b.name == name]
    return found
