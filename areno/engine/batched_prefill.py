"""Prompts prefilled together in one forward: whole prompts without media
(`ModelRunner.prefill_batch`), and parts of prompts over the keys their slots already hold
(`ModelRunner.prefill_parts`: prompts resuming from the prefix cache, a long prompt's chunks);
which prompts may share one, their padding, and each row's last real position."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from areno.engine.prompt_chunks import patched_forward
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
