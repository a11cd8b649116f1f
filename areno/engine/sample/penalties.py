"""What the repetition penalties read: per-slot token counts kept on the device.

A row with a presence, frequency or repetition penalty needs how often each token occurs in its
output so far, and for the repetition penalty which tokens its prompt holds. Rebuilding those
from the host's token lists each step would copy every penalised sequence's whole history every
step; instead each slot keeps a (vocab,) count row and a prompt-presence row on the device,
set when the sequence's prompt is prefilled (`start`) and bumped by each token sampled into it
(`record`, also on the device, so an overlapped step that has not reached the host counts too).
Allocated on the first penalised request: an engine serving none pays nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from areno.engine.transfer import to_device


class TokenHistory:
    """Token counts of the sequences in `num_slots` slots (only penalised ones are kept)."""

    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.device = device
        self.counts_SV: Tensor | None = None  # int32: occurrences in the output so far
        self.in_prompt_SV: Tensor | None = None  # bool: occurs in the prompt

    def start(self, slot: int, prompt_ids: list[int], output_ids: list[int], vocab: int) -> None:
        """Reset `slot` for a sequence whose prompt (and, resumed after preemption, the output
        it had) is being prefilled."""
        if self.counts_SV is None:
            self.counts_SV = torch.zeros(
                self.num_slots, vocab, dtype=torch.int32, device=self.device
            )
            self.in_prompt_SV = torch.zeros(
                self.num_slots, vocab, dtype=torch.bool, device=self.device
            )
        self.counts_SV[slot].zero_()
        self.in_prompt_SV[slot].zero_()
        self.in_prompt_SV[slot, self._ids(prompt_ids)] = True
        if output_ids:
            ones = torch.ones(len(output_ids), dtype=torch.int32, device=self.device)
            self.counts_SV[slot].index_put_((self._ids(output_ids),), ones, accumulate=True)

    def gather(self, slots_P: Tensor) -> tuple[Tensor, Tensor]:
        """(counts, in-prompt) rows of `slots_P`, as (P, vocab) tensors."""
        assert self.counts_SV is not None, "start a penalised slot before gathering it"
        return self.counts_SV[slots_P], self.in_prompt_SV[slots_P]

    def record(self, slots_P: Tensor, token_ids_P: Tensor) -> None:
        """Count each slot's newly sampled token."""
        ones = torch.ones_like(token_ids_P, dtype=torch.int32)
        self.counts_SV.index_put_((slots_P, token_ids_P), ones, accumulate=True)

    def _ids(self, ids: list[int]) -> Tensor:
        return to_device(torch.tensor(ids, dtype=torch.long), self.device)


def apply_penalties(
    logits_PV: Tensor,
    counts_PV: Tensor,
    in_prompt_PV: Tensor,
    presence_P: Tensor,
    frequency_P: Tensor,
    repetition_P: Tensor,
) -> Tensor:
    """Penalised logits: the repetition penalty first (a seen token's positive logit divided by
    it, a negative one multiplied: vLLM's and Hugging Face's rule, prompt and output), then
    OpenAI's `frequency * count + presence * (count > 0)` subtracted (output only)."""
    seen_PV = in_prompt_PV | (counts_PV > 0)
    repetition_P1 = repetition_P[:, None]
    scaled_PV = torch.where(logits_PV > 0, logits_PV / repetition_P1, logits_PV * repetition_P1)
    logits_PV = torch.where(seen_PV, scaled_PV, logits_PV)
    counts_PV = counts_PV.to(logits_PV.dtype)
    return (
        logits_PV
        - frequency_P[:, None] * counts_PV
        - presence_P[:, None] * (counts_PV > 0).to(logits_PV.dtype)
    )
