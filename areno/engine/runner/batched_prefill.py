"""Prompts prefilled together in one forward: whole prompts without media
(`ModelRunner.prefill_batch`), and parts of prompts over the keys their slots already hold
(`ModelRunner.prefill_parts`: prompts resuming from the prefix cache, a long prompt's chunks);
which prompts may share one, their padding, and each row's last real position."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from areno.engine.runner.prompt_chunks import patched_forward
from areno.processing.types import PromptInputs


def can_batch_prefill(inputs: PromptInputs) -> bool:
    """Whether a prompt may share a prefill forward with other prompts (of its length, or any
    length where the runner `can_pad_prefill`): no media, and only per-token tensors (like
    `mm_token_type_ids`) besides its ids."""
    n = inputs.num_prompt_tokens
    return not inputs.mm_spans and all(
        v.ndim == 2 and v.shape == (1, n) for v in inputs.mm_inputs.values()
    )


def pad_tokens(value_1L: torch.Tensor, length: int) -> torch.Tensor:
    """A per-token input (1, L) (token ids, token types) right-padded with 0 to `length`: the
    pads' outputs are never read."""
    extra = length - value_1L.shape[1]
    if not extra:
        return value_1L
    return torch.nn.functional.pad(value_1L, (0, extra))


@contextlib.contextmanager
def last_real_positions(text_stack: torch.nn.Module, run_stack, positions_B: torch.Tensor):
    """Within the block, `text_stack` runs through `run_stack` (its forward, compiled or not)
    and its final hidden states are row b's at `positions_B[b]` only, (B, 1, H): the model's
    `logits_to_keep=1` then projects those."""
    rows_B = torch.arange(len(positions_B), device=positions_B.device)

    def forward(*args, **kwargs):
        out = run_stack(*args, **kwargs)
        out.last_hidden_state = out.last_hidden_state[rows_B, positions_B][:, None]
        return out

    with patched_forward(text_stack, forward):
        yield


@dataclass
class PromptPart:
    """Tokens start..end-1 of a prompt, to prefill into `slot` (its blocks `table`; None: its
    default one) over the keys of its tokens before `start`, which the table's blocks hold (its
    earlier parts, or the prefix cache's). `first`: the slot starts the prompt here (at 0 from
    zero states; past 0 from a state restored into it)."""

    inputs: PromptInputs
    slot: int
    table: list[int] | None
    start: int
    end: int
    first: bool

    @property
    def ends_prompt(self) -> bool:
        return self.end == self.inputs.num_prompt_tokens


def part_masks(pos_BQ: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Causal masks (B, 1, Q, kv_len) of right-padded parts of prompts at positions `pos_BQ`
    over their cached and own keys."""
    keys_K = torch.arange(kv_len, device=pos_BQ.device)
    return (keys_K <= pos_BQ[:, :, None])[:, None]


def part_sliding_masks(
    pos_BQ: torch.Tensor,
    starts_B: torch.Tensor,
    width: int,
    window: int,
    groups_BQ: torch.Tensor | None,
) -> torch.Tensor:
    """Sliding-window masks (B, 1, Q, width + Q) of right-padded parts at positions `pos_BQ`
    over the keys their sliding layers return in a windowed chunk: the `width` positions before
    each row's first token (`starts_B`; those before 0 hidden), then the part's own. A query
    sees the keys of its window, causally, and with `groups_BQ` (each token's bidirectional
    run, -1 outside one) every key of its own run (a part holds its runs whole)."""
    steps_W = torch.arange(width, device=pos_BQ.device)
    keys_BK = torch.cat([starts_B[:, None] - width + steps_W, pos_BQ], dim=1)
    valid_BK = keys_BK >= 0
    seen = (
        valid_BK[:, None, :]
        & (keys_BK[:, None, :] <= pos_BQ[:, :, None])
        & (keys_BK[:, None, :] > pos_BQ[:, :, None] - window)
    )
    if groups_BQ is not None:
        same_BQQ = (groups_BQ[:, :, None] == groups_BQ[:, None, :]) & (groups_BQ[:, :, None] >= 0)
        seen = seen | torch.cat([same_BQQ.new_zeros(*same_BQQ.shape[:2], width), same_BQQ], -1)
    return seen[:, None]


def part_token_ids(parts: list[PromptPart], width: int) -> torch.Tensor:
    """The parts' token ids (B, width), right-padded with 0."""
    return torch.tensor(
        [p.inputs.input_ids[p.start : p.end] + [0] * (width - p.end + p.start) for p in parts]
    )


def stack_rows(cuts: list[dict], width: int) -> dict:
    """Several rows' shares of their prompts' staged text-stack inputs (`StagedPrompt.cut`) as
    one batch right-padded to `width` tokens: per-token tensors (1, Q, ...) padded with zeros,
    position ids (..., 1, Q) with their last column, deepstack features joined in row order
    (the order of the padded visual masks' True entries)."""
    batch = {}
    for key in cuts[0]:
        values = [cut[key] for cut in cuts]
        if key == "position_ids":
            padded = [
                torch.cat([v, v[..., -1:].expand(*v.shape[:-1], width - v.shape[-1])], dim=-1)
                for v in values
            ]
            batch[key] = torch.cat(padded, dim=-2)
        elif key == "deepstack_visual_embeds":
            batch[key] = [torch.cat(layer) for layer in zip(*values, strict=True)]
        else:
            padded = [
                torch.cat([v, v.new_zeros(1, width - v.shape[1], *v.shape[2:])], dim=1)
                for v in values
            ]
            batch[key] = torch.cat(padded)
    return batch
