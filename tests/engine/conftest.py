"""Fixtures of the engine tests: one Setup per family and the media files, built once for every
Generator test module of the package."""

from __future__ import annotations

import pytest

from areno.media.samples import write_audio, write_image, write_video
from tests.engine.generating import Setup


@pytest.fixture(scope="package")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("generator-media")
    return {
        "image": str(write_image(d / "a.png", 64, 48)),
        "video": str(write_video(d / "v.mp4", seconds=2.0, fps=4.0)),
        "audio": str(write_audio(d / "a.wav", seconds=1.0)),
    }


@pytest.fixture(scope="package")
def setups(tiny_path):
    cache: dict[str, Setup] = {}

    def get(family: str) -> Setup:
        if family not in cache:
            cache[family] = Setup(tiny_path(family))
        return cache[family]

    return get


@pytest.fixture(params=["off", "on"], ids=["steps", "overlapped"])
def overlap(request) -> str:
    """Both step loops: each step read before the next, and overlapped (a step launched before
    the previous one's tokens are read)."""
    return request.param


@pytest.fixture
def whole_sorts(monkeypatch) -> dict:
    """Counts the sampler's sorts of whole rows (`_sorted_filter`): {"n": calls so far}."""
    from areno.engine.sample import sampler

    sorts = {"n": 0}
    whole_sort = sampler._sorted_filter

    def counted(*args):
        sorts["n"] += 1
        return whole_sort(*args)

    monkeypatch.setattr(sampler, "_sorted_filter", counted)
    return sorts
