"""The color quiz with a canary in every sample's private metadata, to prove that private data
reaches the reward and nothing else (not the prompt, a tool, a metric, a log line)."""

from __future__ import annotations

from areno.tasks import color_quiz

# Built at import so that no source file holds the whole string (the search below is exact).
CANARY = "-".join(["CANARY", "e41f", "private", "answer", "key"])


def load(**kwargs):
    for sample in color_quiz.load(**kwargs):
        sample.private["canary"] = CANARY
        yield sample


def reward(trajectory, private: dict) -> dict[str, float]:
    if private.get("canary") != CANARY:
        raise AssertionError("the reward did not receive the sample's private metadata")
    return color_quiz.reward(trajectory, private)
