"""The compile cache directory AReno owns (areno/engine/compile_cache.py): where it points
Inductor, what it leaves to the user, and that a compiled start-up reports its phases."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from areno.engine import compile_cache


@pytest.fixture
def env(monkeypatch, tmp_path):
    for name in (compile_cache.ENV, "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return monkeypatch


def test_inductor_is_pointed_at_a_directory_keyed_by_versions_and_device(env, tmp_path):
    path = compile_cache.use(torch.device("cpu"))
    assert path == tmp_path / "xdg" / "areno" / "compile" / compile_cache.cache_key(
        torch.device("cpu")
    )
    assert path.is_dir() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert Path(cache_dir()) == path  # what Inductor itself resolves
    # a later engine of the process keeps it
    assert compile_cache.use(torch.device("cpu")) == path


def test_the_key_changes_with_the_device_kind_and_the_versions(env, monkeypatch):
    cpu = compile_cache.cache_key(torch.device("cpu"))
    assert cpu.startswith("cpu-") and cpu == compile_cache.cache_key(torch.device("cpu"))
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert compile_cache.cache_key(torch.device("cpu")) != cpu


def test_a_root_of_the_users_and_off_are_honoured(env, tmp_path):
    env.setenv(compile_cache.ENV, str(tmp_path / "mine"))
    path = compile_cache.use(torch.device("cpu"))
    assert path.parent == tmp_path / "mine"

    env.delenv("TORCHINDUCTOR_CACHE_DIR")
    env.setenv(compile_cache.ENV, "off")
    assert compile_cache.use(torch.device("cpu")) is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # torch's default stays

    env.delenv(compile_cache.ENV)
    env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    assert compile_cache.use(torch.device("cpu")) is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "theirs")


def test_torchs_own_default_in_the_variable_is_not_taken_for_a_users_choice(env):
    """Importing torch._dynamo writes torch's default directory into TORCHINDUCTOR_CACHE_DIR
    (its first cache_dir() call), which once made every engine keep torch's directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    default = cache_dir()  # what torch does on import: sets the variable to its default
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default
    path = compile_cache.use(torch.device("cpu"))
    assert path is not None and (path / ".areno").is_file()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path) != default


def test_entries_are_counted(tmp_path):
    assert compile_cache.num_entries(None) == 0
    assert compile_cache.num_entries(tmp_path / "missing") == 0
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x").write_text("x")
    (tmp_path / "y").write_text("y")
    assert compile_cache.num_entries(tmp_path) == 2


def test_a_compiled_start_up_reports_its_phases_and_cache(env, tiny_path):
    from areno.engine.config import EngineConfig
    from areno.engine.generator import Generator

    config = EngineConfig(
        max_running_prompts=2, max_context_len=64, device="cpu", decode_graphs="static",
        decode_compile="aot_eager", prefill_compile="off",
    )  # fmt: skip
    generator = Generator.from_config(tiny_path("qwen3_5"), config)
    try:
        generator.warm_up({})
        assert list(generator.start_up) == ["load", "cache", "compile", "warm-up"]
        assert all(seconds >= 0 for seconds in generator.start_up.values())
        line = generator.describe_start_up()
        assert line.startswith("load ") and " compile " in line and "(total " in line
        assert f"compile cache {generator.compile_cache} (" in line
        # The decode step compiles (the prefills run uncompiled): its seconds, by name.
        assert list(generator.start_up_compiles) == ["decode step"]
        assert line.endswith(
            f"; compiles: decode step {generator.start_up_compiles['decode step']:.1f} s"
        )
        assert generator.compile_cache == Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    finally:
        generator.shutdown()


def test_an_engine_over_a_loaded_model_uses_the_cache_too(env, tiny_path, tmp_path):
    """`Generator.from_model` (tests, benchmarks) points Inductor at the directory
    `from_config` uses."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from areno.engine.config import EngineConfig
    from areno.engine.generator import Generator

    path = tiny_path("qwen3_5")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    config = EngineConfig(max_running_prompts=1, max_context_len=32, device="cpu")
    generator = Generator.from_model(model, AutoTokenizer.from_pretrained(path), config)
    try:
        assert generator.compile_cache == Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        assert generator.compile_cache.parent == tmp_path / "xdg" / "areno" / "compile"
    finally:
        generator.shutdown()
