"""Media tower outputs kept by the content they encoded, so that an image, a video or a clip of
audio seen again is not encoded again: another sample of a GRPO group, the next turn of an
episode (its prompt holds every earlier turn's media), the next request of a chat.

transformers' multimodal models encode a prompt's media per modality, one call each to
`get_image_features`, `get_video_features`, `get_audio_features`, over every item of that
modality in the prompt. Around a prefill's forward, `EncoderCache.around` answers each such
call from the cache when the prompt's items of that modality (their content hashes and
placeholder counts, in order) were encoded before, and keeps what a missed call returns. A
prompt that adds an image to earlier turns' video thus encodes the images only.

Bounded by bytes, least recently used evicted first; new weights clear it (`clear`).
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any

import torch

from areno.processing.types import MediaSpan

_METHODS = {
    "image": "get_image_features",
    "video": "get_video_features",
    "audio": "get_audio_features",
}


class EncoderCache:
    """Tower outputs of one model by (modality, its items in a prompt); see the module docstring."""

    def __init__(self, model: torch.nn.Module, max_bytes: int):
        # The module whose forward calls the feature methods (transformers' `model.model`).
        self.owner = getattr(model, "model", model)
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_hits = self.num_misses = 0
        # host seconds spent in the towers' missed calls (on a GPU: to their launch's return)
        self.encode_s = 0.0
        self._encoding = False  # inside a missed call's own encoding
        self._entries: collections.OrderedDict[tuple, tuple[Any, int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.contextmanager
    def around(self, spans: list[MediaSpan], model: torch.nn.Module | None = None):
        """Within the block, the owner's feature methods answer from the cache for `spans`, the
        media items of the prompt being prefilled; `model`: another model's (with the same
        towers) answer from this cache instead."""
        owner = self.owner if model is None else getattr(model, "model", model)
        patched = []
        for modality, name in _METHODS.items():
            items = tuple(
                (s.content_hash, s.num_placeholder_tokens) for s in spans if s.modality == modality
            )
            if not items or not hasattr(owner, name) or not self.max_bytes:
                continue
            patched.append((name, owner.__dict__.get(name)))
            setattr(owner, name, self._cached(getattr(owner, name), (modality, items)))
        try:
            yield
        finally:
            for name, own in patched:
                if own is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, own)

    def _cached(self, encode, key: tuple):
        def features(*args, **kwargs):
            if self._encoding:
                # NOTE: one feature method calling another (Qwen's get_video_features encodes
                # frames with get_image_features) is part of the outer call, not a lookup.
                return encode(*args, **kwargs)
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
                return entry[0]
            self.num_misses += 1
            self._encoding = True
            start = time.perf_counter()
            try:
                output = encode(*args, **kwargs)
            finally:
                self._encoding = False
                self.encode_s += time.perf_counter() - start
            self._put(key, output)
            return output

        return features

    def _put(self, key: tuple, output: Any) -> None:
        num_bytes = sum(t.numel() * t.element_size() for t in _tensors(output))
        if num_bytes > self.max_bytes:
            return
        while self._entries and self.num_bytes + num_bytes > self.max_bytes:
            _, (_, freed) = self._entries.popitem(last=False)
            self.num_bytes -= freed
        self._entries[key] = (output, num_bytes)
        self.num_bytes += num_bytes

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors a tower's output holds (a ModelOutput, a tuple, nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []
