"""What the runner keeps and builds to prefill a prompt in chunks (`ModelRunner.prefill_chunk`).

A prompt's first chunk runs the model's own forward over the whole prompt up to its text stack:
the towers encode every media item once, and what the stack receives is kept (`StagedPrompt`)
while the stack runs on the chunk's part; a later chunk swaps its part of the kept inputs in for
what the model's forward gives the stack. Both work by patching the text stack's `forward` for
one call (`patched_forward`). A chunk never cuts a run of tokens that attend to each other both
ways (`runs_of`), and its masks let such a run see itself (`chunk_masks`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass
class StagedPrompt:
    """The text stack's inputs for a whole prompt prefilled in chunks, as the model's forward
    gave them at its first chunk; `cut` gives a chunk's part."""

    per_token: dict[str, torch.Tensor]  # (1, L, ...): inputs_embeds, per_layer_inputs, ...
    position_ids: torch.Tensor  # (..., L)
    groups: torch.Tensor | None  # each token's bidirectional run (L,), -1 outside one
    # Qwen3-VL: each deepstack layer's features of the prompt's vision tokens, and how many
    # vision tokens come before each position (L + 1,).
    deepstack: list[torch.Tensor] | None = None
    vision_before: list[int] | None = None

    @classmethod
    def capture(cls, kwargs: dict, num_tokens: int, groups: torch.Tensor | None) -> StagedPrompt:
        per_token = {
            key: value
            for key, value in kwargs.items()
            if key not in ("attention_mask", "position_ids")
            and isinstance(value, torch.Tensor)
            and value.ndim >= 2
            and value.shape[:2] == (1, num_tokens)
        }
        deepstack, vision_before = kwargs.get("deepstack_visual_embeds"), None
        if deepstack is not None:
            mask = per_token["visual_pos_masks"][0]
            vision_before = [0] + torch.cumsum(mask.long(), 0).tolist()
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # the stack counts from the cache: plain positions
            device = next(iter(per_token.values())).device
            position_ids = torch.arange(num_tokens, device=device)[None]
        return cls(per_token, position_ids, groups, deepstack, vision_before)

    def nbytes(self) -> int:
        tensors = [*self.per_token.values(), self.position_ids, *(self.deepstack or [])]
        return sum(t.numel() * t.element_size() for t in tensors)

    def cut(self, start: int, end: int) -> dict:
        """The stack's inputs for tokens start..end-1."""
        inputs = {key: value[:, start:end] for key, value in self.per_token.items()}
        inputs["position_ids"] = self.position_ids[..., start:end]
        if self.deepstack is not None:
            first, last = self.vision_before[start], self.vision_before[end]
            inputs["deepstack_visual_embeds"] = [e[first:last] for e in self.deepstack]
        return inputs


class RecentStaged:
    """The stack inputs and rope delta of the latest prompts staged (`at_text_stack`), by prompt
    object: at most `size` of them and `max_bytes` of tensors, the least recently used leaving
    first, and an entry whose object no one holds any more at the next `put`.

    A GRPO group's episodes send one `PromptInputs` object each, and each episode's resumption
    from the prefix cache stages the whole prompt again (its media through the encoder cache,
    its tokens embedded) to take its part of it: a color quiz step's 16 prompts were staged 128
    times. The staged inputs depend on the weights only (LoRA adapters act inside the text
    stack), so whoever changes weights must `clear` it. Keyed by identity, not by content: a hit
    costs no hashing, and a new request builds a new object. The bytes stay small beside the
    KV pool (which does not count them): at the 2B Qwen3.5 shape (hidden 2048, bf16) 0.3 MB
    for a 79-token color quiz prompt, 7.4 MB for 1,800 tokens."""

    def __init__(self, size: int = 16, max_bytes: int = 128 << 20):
        self.size, self.max_bytes = size, max_bytes
        self._entries: OrderedDict[int, tuple[weakref.ref, StagedPrompt, int, int]] = OrderedDict()
        self._bytes = 0

    def get(self, prompt: object) -> tuple[StagedPrompt, int] | None:
        entry = self._entries.get(id(prompt))
        if entry is None or entry[0]() is not prompt:
            return None
        self._entries.move_to_end(id(prompt))
        return entry[1], entry[2]

    def put(self, prompt: object, staged: StagedPrompt, delta: int) -> None:
        for key in [k for k, entry in self._entries.items() if entry[0]() is None]:
            self._drop(key)  # a prompt no request holds any more
        size = staged.nbytes()
        if size > self.max_bytes:
            return
        self._drop(id(prompt))
        self._entries[id(prompt)] = (weakref.ref(prompt), staged, delta, size)
        self._bytes += size
        while len(self._entries) > self.size or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[3]

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


@contextlib.contextmanager
def patched_forward(stack: torch.nn.Module, forward: Callable) -> Iterator[None]:
    """Within the block, `stack` runs `forward` in place of its class's."""
    assert "forward" not in vars(stack), "the text stack's forward is its class's"
    stack.forward = forward
    try:
        yield
    finally:
        del stack.forward


class _AtTextStack(Exception):
    """Ends a forward where it reaches the text stack (`at_text_stack`)."""


def at_text_stack(
    model: torch.nn.Module, stack: torch.nn.Module, model_inputs: dict, num_tokens: int
) -> StagedPrompt:
    """The text stack's inputs for a prompt of `num_tokens`, from `model`'s own forward over
    `model_inputs`, stopped where it reaches `stack` (which never runs): the towers have encoded
    its media there (or an encoder cache answered), and the tensors keep the autograd graph of
    whatever computed them."""
    captured: list[StagedPrompt] = []

    def stop(*args, **kwargs):
        captured.append(StagedPrompt.capture(kwargs, num_tokens, None))
        raise _AtTextStack

    with contextlib.suppress(_AtTextStack), patched_forward(stack, stop):
        model(**model_inputs, use_cache=False)
    return captured[0]


def staging(
    stack: torch.nn.Module,
    keep: Callable[[StagedPrompt], None],
    num_tokens: int,
    end: int,
    groups: torch.Tensor | None,
    start: int = 0,
    chunk: Callable[[StagedPrompt], dict] | None = None,
):
    """Within the block, the stack's inputs for a whole prompt of `num_tokens` go to `keep` and
    the stack runs on their tokens `start`..`end`-1. From a `start` past 0 (a prompt whose
    first tokens' keys are cached already) `chunk` binds the cache to the chunk just before the
    stack runs and returns its masks and tables, as for a later chunk."""
    forward_class = type(stack).forward

    def forward(*args, **kwargs):
        staged = StagedPrompt.capture(kwargs, num_tokens, groups)
        keep(staged)
        kwargs |= staged.cut(start, end)
        if chunk is None:
            kwargs["attention_mask"] = _first_rows(kwargs.get("attention_mask"), end)
        else:
            kwargs |= chunk(staged)
            if kwargs.get("cache_position") is not None:
                cache_position = kwargs["cache_position"]
                kwargs["cache_position"] = torch.arange(start, end, device=cache_position.device)
        return forward_class(stack, *args, **kwargs)

    return patched_forward(stack, forward)


def stack_inputs(stack: torch.nn.Module, inputs: dict):
    """Within the block, the stack takes `inputs` in place of those the model's forward gives it
    (a later chunk's part of its prompt's kept inputs)."""
    forward_class = type(stack).forward

    def forward(*args, **kwargs):
        return forward_class(stack, *args, **(kwargs | inputs))

    return patched_forward(stack, forward)


def _first_rows(mask, end: int):
    """A prefill's attention mask(s) for its first `end` tokens: a (1, L) padding mask cut to
    (1, end), a (1, 1, L, L) mask to (1, 1, end, end); a mapping by layer kind, each."""
    if isinstance(mask, dict):
        return {kind: _first_rows(m, end) for kind, m in mask.items()}
    if mask is None:
        return None
    return mask[:, :end] if mask.ndim == 2 else mask[..., :end, :end]


def bidirectional_groups(token_types_L: torch.Tensor) -> torch.Tensor:
    """As Gemma 4 marks them (`use_bidirectional_attention` "vision"): each maximal run of image
    or video tokens (token types 1, 2) is a group seen both ways by the sliding layers. Each
    token's group (L,), -1 outside one."""
    vision = (token_types_L == 1) | (token_types_L == 2)
    starts = vision & ~torch.cat([vision.new_zeros(1), vision[:-1]])
    return torch.where(vision, torch.cumsum(starts.long(), 0) - 1, -1)


def runs_of(groups_L: torch.Tensor | None) -> list[tuple[int, int]]:
    """The (start, end) token runs of `bidirectional_groups`' groups, in order."""
    if groups_L is None:
        return []
    runs: list[list[int]] = []
    ids = groups_L.tolist()
    for i, group in enumerate(ids):
        if group >= 0 and (i == 0 or ids[i - 1] != group):
            runs.append([i, i + 1])
        elif group >= 0:
            runs[-1][1] = i + 1
    return [(start, end) for start, end in runs]


def chunk_masks(pos_Q: torch.Tensor, kv_len: int, window: int | None, groups: torch.Tensor | None):
    """A chunk's masks (1, 1, Q, kv_len) over its cached and own keys: causal, and with a
    sliding `window` a mapping by layer kind whose sliding mask is windowed and lets the tokens
    of one bidirectional group (`groups`) see each other."""
    keys = torch.arange(kv_len, device=pos_Q.device)[None, :]
    full = (keys <= pos_Q[:, None])[None, None]
    if not window:
        return full
    seen = full
    if groups is not None:
        query_groups = groups[pos_Q][:, None]
        same = (query_groups == groups[None, :kv_len]) & (query_groups >= 0)
        seen = full | same[None, None]
    recent = (keys > pos_Q[:, None] - window)[None, None]
    return {"full_attention": full, "sliding_attention": seen & recent}
