"""Family adapters: lookup, modality checks, media towers that exist in the real model classes."""

from __future__ import annotations

import json

import pytest

from areno.errors import UnsupportedModalityError, UnsupportedModelError
from areno.models import adapter_for_checkpoint, get_adapter, supported_model_types
from areno.models.tiny import TINY_FAMILIES


def test_every_tiny_family_has_an_adapter():
    assert set(TINY_FAMILIES) <= set(supported_model_types())


def test_unknown_model_type_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="llama.*qwen3_5"):
        get_adapter("llama")


def test_not_a_checkpoint_names_the_path(tmp_path):
    with pytest.raises(UnsupportedModelError, match=str(tmp_path)):
        adapter_for_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="bert"):
        adapter_for_checkpoint(tmp_path)


def test_modality_check_names_family_and_accepted():
    with pytest.raises(UnsupportedModalityError, match=r"Qwen3\.5.*audio.*image, video"):
        get_adapter("qwen3_5").check_modality("audio")
    get_adapter("gemma4").check_modality("audio")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_media_towers_and_projectors_exist(tiny_path, family):
    path = tiny_path(family)
    adapter = adapter_for_checkpoint(path)
    model = adapter.load_model(path)
    for name in (*adapter.media_towers, *adapter.projectors):
        module = model.get_submodule(name)
        assert sum(p.numel() for p in module.parameters()) > 0, name
    lm = model.get_submodule("model.language_model")
    tower_params = {
        id(p) for n in adapter.media_towers for p in model.get_submodule(n).parameters()
    }
    assert not tower_params & {id(p) for p in lm.parameters()}
