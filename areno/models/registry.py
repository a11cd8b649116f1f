"""Family adapters: what AReno needs to know about each checkpoint family, keyed by model_type.

An adapter is data, not code paths: the Auto class that loads the family, the modalities its
processor accepts, the media towers to freeze for training, its tool-call format and stop tokens.
Adding a family is adding one `FamilyAdapter` (see families.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from areno.errors import UnsupportedModalityError, UnsupportedModelError

_ADAPTERS: dict[str, FamilyAdapter] = {}


@dataclass(frozen=True)
class FamilyAdapter:
    model_type: str
    display_name: str
    modalities: frozenset[str]
    media_towers: tuple[str, ...]  # module paths from the top-level model, frozen in training
    projectors: tuple[str, ...]  # media -> text projections (frozen with the towers by default)
    tool_format: str  # name of the tool-call parser (areno.tools)
    stop_tokens: tuple[str, ...]  # end-of-turn tokens besides the tokenizer's eos
    auto_class: str = "AutoModelForImageTextToText"
    video_with_audio: bool = False  # a video's audio track goes to the model as an audio item
    # Whether the forward takes several prompts' media concatenated along their first dimension
    # (the processor's batch layout): trajectories with media then share a trainer forward.
    batched_media: bool = True
    # Extra kwargs for the processor call, per modality group ("images_kwargs", "videos_kwargs"...).
    processor_kwargs: dict[str, dict] = field(default_factory=dict)
    # Tensor parallelism: whether transformers has a TP plan for the family's text stack, and
    # rules that override that plan (module path -> style) where the default one is wrong.
    supports_tp: bool = True
    tp_plan_overrides: dict[str, str] = field(default_factory=dict)

    def check_modality(self, modality: str) -> None:
        """Raise a clear error when this family cannot take `modality`."""
        if modality not in self.modalities:
            accepted = ", ".join(sorted(self.modalities))
            raise UnsupportedModalityError(
                f"{self.display_name} ({self.model_type}) checkpoints do not accept {modality} "
                f"input; this family accepts: {accepted}"
            )

    def load_model(self, path: str | os.PathLike, **kwargs):
        """Load the checkpoint with the family's Auto class (kwargs go to from_pretrained)."""
        import transformers

        return getattr(transformers, self.auto_class).from_pretrained(path, **kwargs)


def register(adapter: FamilyAdapter) -> FamilyAdapter:
    _ADAPTERS[adapter.model_type] = adapter
    return adapter


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def get_adapter(model_type: str) -> FamilyAdapter:
    """The adapter for `model_type` (config.json's model_type)."""
    try:
        return _ADAPTERS[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported families: "
            f"{', '.join(supported_model_types())}. Add a FamilyAdapter in areno/models/families.py"
        ) from None


def read_model_type(model_path: str | os.PathLike) -> str:
    """config.json's model_type, with an error naming the path when it is not a checkpoint."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        raise UnsupportedModelError(
            f"{model_path} is not a Hugging Face checkpoint directory (no config.json there)"
        )
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"cannot read {config}: {e}") from None
    if not model_type:
        raise UnsupportedModelError(f"{config} has no model_type")
    return model_type


def adapter_for_checkpoint(model_path: str | os.PathLike) -> FamilyAdapter:
    return get_adapter(read_model_type(model_path))
