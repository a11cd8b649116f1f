"""What the processor hands to the generator: one encoded prompt."""

from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class MediaSpan:
    """Where one media item sits in the encoded prompt.

    `start` / `end` (half-open) cover the whole expansion the processor wrote for the item
    (begin / end markers, timestamps, and the placeholder tokens); `num_placeholder_tokens` counts
    only the placeholder tokens, i.e. the features the media tower produces for it.
    """

    modality: str
    index: int  # position among the request's media items
    start: int
    end: int
    num_placeholder_tokens: int
    content_hash: str  # the decoded item's (source bytes and decoding options)


@dataclass
class PromptInputs:
    """A processor-encoded prompt: token ids plus every media tensor the model's forward needs."""

    input_ids: list[int]
    mm_inputs: dict[str, torch.Tensor]  # pixel_values, image_grid_thw, input_features, ...
    mm_spans: list[MediaSpan] = field(default_factory=list)
    prompt_text: str = ""  # the rendered chat template before placeholder expansion

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def cache_key(self) -> str:
        """A content hash of the prompt: token ids plus the media items' content hashes."""
        h = hashlib.sha256()
        h.update(torch.tensor(self.input_ids, dtype=torch.int64).numpy().tobytes())
        for span in self.mm_spans:
            h.update(span.content_hash.encode())
        return h.hexdigest()

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Batch-of-one tensors for `model(**inputs)`."""
        ids = torch.tensor([self.input_ids], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **self.mm_inputs}

    def num_tokens(self, modality: str) -> int:
        return sum(s.num_placeholder_tokens for s in self.mm_spans if s.modality == modality)

    def __reduce__(self):
        """Pickled with its tensors as NumPy arrays, which Ray hands between processes out of
        band; torch's own pickling of even a (1, 32) token-type tensor costs ~0.2 ms a hop, and
        a prompt crosses two (Processor or Ingress -> Generator, rollout worker actors).
        A tensor that several prompts of one pickle share (a GRPO group's episodes share their
        prompt's media) is pickled once, and unpickled as one tensor (`_SharedViews`)."""
        arrays = {key: _portable(value) for key, value in self.mm_inputs.items()}
        return (_rebuilt, (self.input_ids, arrays, self.mm_spans, self.prompt_text))

    def with_tokens(self, input_ids: list[int]) -> PromptInputs:
        """The same media with a longer token sequence (this prompt followed by more tokens, e.g.
        a sampled continuation to score). Per-token tensors such as Gemma's `mm_token_type_ids`
        are extended with zeros (text) to the new length."""
        n = self.num_prompt_tokens
        if input_ids[:n] != self.input_ids:
            raise ValueError("input_ids must start with this prompt's token ids")
        extra = len(input_ids) - n
        mm_inputs = {
            key: torch.nn.functional.pad(value, (0, extra))
            if _is_per_token(key, value, n)
            else value
            for key, value in self.mm_inputs.items()
        }
        return PromptInputs(list(input_ids), mm_inputs, list(self.mm_spans), self.prompt_text)


def _is_per_token(key: str, value: torch.Tensor, num_tokens: int) -> bool:
    return key.endswith("token_type_ids") and value.ndim == 2 and value.shape[-1] == num_tokens


class _SharedViews:
    """The view made of each object while both live: `_portable`'s array of a tensor, or
    `_rebuilt`'s tensor of an array, the same object each time within one pickle (whose memo
    keeps the view alive), so pickle writes, and reads back, a shared tensor once."""

    def __init__(self, make) -> None:
        self._make = make
        self._views: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        # A Ray actor's threads pickle at once (a worker's calls, its object transfers).
        self._lock = threading.Lock()

    def __call__(self, source):
        with self._lock:
            entry = self._views.get(id(source))
            if entry is not None and entry[0]() is source:
                view = entry[1]()
                if view is not None:
                    return view
            view = self._make(source)
            if len(self._views) >= 1024:
                self._views = {k: v for k, v in self._views.items() if v[0]() is not None}
            self._views[id(source)] = (weakref.ref(source), weakref.ref(view))
            return view


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    # copied where the buffer Ray read it into is read-only
    return torch.from_numpy(array if array.flags.writeable else array.copy())


_array_of = _SharedViews(lambda tensor: tensor.numpy())
_tensor_of = _SharedViews(_as_tensor)


def _portable(value: torch.Tensor):
    """A CPU tensor as a NumPy array where NumPy has its dtype (not bfloat16); else itself."""
    if value.device.type != "cpu" or value.requires_grad or value.dtype == torch.bfloat16:
        return value
    return _array_of(value)


def _rebuilt(input_ids, arrays, mm_spans, prompt_text) -> PromptInputs:
    """`PromptInputs.__reduce__`'s arrays back as tensors (copied where the buffer Ray read them
    into is read-only)."""
    mm_inputs = {
        key: _tensor_of(value) if isinstance(value, np.ndarray) else value
        for key, value in arrays.items()
    }
    return PromptInputs(input_ids, mm_inputs, mm_spans, prompt_text)
