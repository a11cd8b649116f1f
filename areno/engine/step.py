"""What one engine step carries between the engine core and the workers that run it.

The core schedules a step and sends a `StepInput` (the prompts to prefill, the rows to decode,
how to sample each output row); the sampling worker answers with a `StepOutput` (host lists,
copied once), or a `PendingStep` while its tokens are still on their way to the host. Under
tensor parallelism the other ranks get `StepInput.for_followers()`: the forward's inputs only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from areno.engine.sample.sampler import SamplerOutput
from areno.engine.sampling import SamplingParams
from areno.processing.types import PromptInputs


@dataclass
class PrefillItem:
    """One prompt to run into `slots[0]` and fork into the rest (its n samples), slot i keeping
    its keys and values in `block_tables[i]` (None: the runner's default tables)."""

    inputs: PromptInputs
    slots: list[int]
    block_tables: list[list[int]] | None = None
    # A chunk of a long prompt: tokens start..end-1 (end None: to the prompt's end). Only the
    # chunk that ends the prompt samples (has output rows).
    start: int = 0
    end: int | None = None
    # The first tokens whose keys the table's blocks hold from the prefix cache: the prompt's
    # first chunk starts there, from the state saved in `restore_row` where the model keeps
    # one, its tail block copied as `copy_block` (source, destination) says.
    cached: int = 0
    restore_row: int | None = None
    copy_block: tuple[int, int] | None = None
    # (position, row) pairs, by position: save slots[0]'s state in saved-state `row` when the
    # prefill reaches `position` (areno/engine/kv/state_cache.py).
    saves: list[tuple[int, int]] = field(default_factory=list)
    # The LoRA adapter its sequences run with (SamplingParams.adapter; None: the default).
    adapter: str | None = None

    @property
    def is_chunk(self) -> bool:
        return self.start > 0 or (self.end is not None and self.end < self.inputs.num_prompt_tokens)

    @property
    def is_final(self) -> bool:
        return self.end is None or self.end == self.inputs.num_prompt_tokens


@dataclass
class RowSampling:
    """How to sample one output row: its parameters and its sequence's seed.

    draw: the index among its sequence's outputs of the token this row samples (a seeded row's
    uniform number is a function of its seed and this). history: on a penalised row's prefill,
    its (prompt, output so far) token ids, which reset its slot's counts
    (areno/engine/sample/penalties.py). banned: tokens it cannot draw this step (its stop
    tokens, before min_tokens)."""

    params: SamplingParams
    seed: int | None = None
    draw: int = 0
    history: tuple[list[int], list[int]] | None = None
    banned: tuple[int, ...] = ()


@dataclass
class StepInput:
    """One engine step. Output rows: each prefill item's slots in order, then the decode rows.

    `decode_token_ids` None: each decode row feeds the token last sampled into its slot, which
    the sampling worker keeps on the device (how a step runs before the host has read the
    previous step's tokens)."""

    prefill: list[PrefillItem] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    decode_token_ids: list[int] | None = field(default_factory=list)
    # Each decode row's block table (None: the tables the runner last had for those slots).
    decode_block_tables: list[list[int]] | None = None
    rows: list[RowSampling] = field(default_factory=list)
    # (slot, row): save ended sequences' slot states first (areno/engine/kv/state_cache.py).
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # Rows under a grammar and their allowed-token masks (areno/engine/outputs/grammar.py), host-side.
    grammar_rows: list[int] = field(default_factory=list)
    token_bitmask: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        prefill_rows = sum(len(item.slots) for item in self.prefill if item.is_final)
        return prefill_rows + len(self.decode_slots)

    def for_followers(self) -> StepInput:
        """What a non-sampling rank needs: the forward inputs only (keeps the message small)."""
        return StepInput(
            self.prefill,
            self.decode_slots,
            self.decode_positions,
            self.decode_token_ids,
            self.decode_block_tables,
            state_saves=self.state_saves,
        )


@dataclass
class StepOutput:
    """Sampled tokens per row, on the host. Top-logprob lists hold `params.top_logprobs` items."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


@dataclass
class PendingStep:
    """A launched step's sampled tokens on their way to the host (`Worker.launch`)."""

    packed_BC: torch.Tensor  # SamplerOutput.packed(), in (pinned) host memory once `copied`
    copied: torch.cuda.Event | None  # None on CPU, where the copy was synchronous
    params: list[SamplingParams]

    def result(self) -> StepOutput:
        """Wait for the copy and read it."""
        if self.copied is not None:
            self.copied.synchronize()
        token_ids, logprobs, top_ids, top_lps = SamplerOutput.unpack(self.packed_BC)
        top = [
            list(zip(top_ids[i][: p.top_logprobs], top_lps[i][: p.top_logprobs], strict=True))
            for i, p in enumerate(self.params)
        ]
        return StepOutput(token_ids, logprobs, top)
