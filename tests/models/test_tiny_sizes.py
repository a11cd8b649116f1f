"""Checkpoint sizes: "small" scales the text model to ~30 M parameters and keeps everything else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor

from areno.cli import main
from areno.errors import ConfigError
from areno.models import adapter_for_checkpoint
from areno.models.tiny import TINY_VERSION, build_tiny, cache_dir, tiny_checkpoint

SMALL_FAMILIES = ("qwen3_5", "gemma4")


@pytest.fixture(scope="module")
def small_path(tmp_path_factory: pytest.TempPathFactory):
    """small_path(family) -> a small checkpoint directory of that family (built on first use)."""
    root = tmp_path_factory.mktemp("small")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny(family, root / family, size="small")
        return built[family]

    return get


@pytest.mark.parametrize("family", SMALL_FAMILIES)
def test_small_reloads_and_runs_forward(small_path, family):
    path = small_path(family)
    adapter = adapter_for_checkpoint(path)
    assert adapter.model_type == family
    model = adapter.load_model(path).eval()
    num_params = sum(p.numel() for p in model.parameters())
    assert 20_000_000 <= num_params <= 45_000_000
    text = model.config.get_text_config()
    assert text.hidden_size == 512
    assert len(set(text.layer_types)) == 2  # the family's hybrid layer pattern is kept
    processor = AutoProcessor.from_pretrained(path)
    ids = processor.tokenizer("Describe the scene.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", SMALL_FAMILIES)
def test_small_keeps_tokenizer_and_template(small_path, tiny_path, family):
    small, tiny = small_path(family), tiny_path(family)
    for name in ("tokenizer.json", "chat_template.jinja", "processor_config.json"):
        assert (small / name).read_text() == (tiny / name).read_text(), name


def test_unknown_size_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"'huge'.*'tiny', 'small', '2b'"):
        build_tiny("qwen3_5", tmp_path, size="huge")
    with pytest.raises(ConfigError, match="huge"):
        tiny_checkpoint("qwen3_5", size="huge")


def test_cache_dir_names_the_size_except_for_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("ARENO_CACHE_DIR", str(tmp_path))
    # Pre-made directories: tiny_checkpoint returns them without building.
    for name in (f"gemma4-v{TINY_VERSION}", f"gemma4-small-v{TINY_VERSION}"):
        (cache_dir() / name).mkdir(parents=True)
        (cache_dir() / name / "config.json").write_text("{}")
    assert tiny_checkpoint("gemma4").name == f"gemma4-v{TINY_VERSION}"
    assert tiny_checkpoint("gemma4", size="small").name == f"gemma4-small-v{TINY_VERSION}"


def test_cli_prints_size_and_parameter_count(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "ckpt"), "--family", "qwen3_vl"]) == 0
    assert "qwen3_vl (tiny, 0.27 M parameters)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["make-tiny", str(tmp_path / "other"), "--size", "huge"])


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4", "minicpmv4_6", "qwen3_vl"])
def test_2b_has_the_real_text_stack(family):
    # Built on the meta device: shapes only, no 5 GB of random weights.
    from areno.models.tiny import builders

    with torch.device("meta"):
        model = builders()[family]("2b").model
    num_params = sum(p.numel() for p in model.parameters())
    assert 0.9e9 <= num_params <= 1.5e9, num_params
    text = model.config.get_text_config()
    assert text.hidden_size in (1536, 2048) and text.num_hidden_layers in (24, 35)
