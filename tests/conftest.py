"""Shared fixtures: tiny checkpoints of every family, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_path(tiny_root: Path):
    """tiny_path(family) -> a tiny checkpoint directory of that family (built on first use)."""
    from areno.models.tiny import build_tiny

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny(family, tiny_root / family)
        return built[family]

    return get
