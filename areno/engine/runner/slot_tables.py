"""Each slot's block table, kept by the runner between steps: the blocks of the KV pool that hold
the slot's sequence, in order, with SINK_BLOCK past them. The engine sends a row's table when it
starts a sequence and whenever the table grows; a step reads the tables of its rows from here."""

from __future__ import annotations

import torch

from areno.engine.kv.block_manager import SINK_BLOCK, blocks_for
from areno.engine.transfer import to_device


class SlotTables:
    """`num_slots` tables of up to `max_blocks` blocks of `block_size` tokens, on the host."""

    def __init__(self, num_slots: int, max_blocks: int, block_size: int):
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.tables_SN = torch.full((num_slots, max_blocks), SINK_BLOCK, dtype=torch.long)
        self._lens = [0] * num_slots

    def default(self, slot: int, num_blocks: int) -> list[int]:
        """The blocks a slot holds when the caller sends no tables (tests, benchmarks of the
        runner alone): `max_blocks` of its own, in order, in a pool of `num_blocks`."""
        first = 1 + slot * self.max_blocks
        assert first + self.max_blocks - 1 <= num_blocks, "the pool has no default tables"
        return list(range(first, first + self.max_blocks))

    def set(
        self, slots: list[int], tables: list[list[int]] | None, *, new: bool, num_blocks: int
    ) -> None:
        """Record each slot's table (None: the default ones). `new`: the slot starts a sequence;
        else its table has only grown since it was last set, and only its new blocks are
        written."""
        for i, slot in enumerate(slots):
            table = tables[i] if tables is not None else self.default(slot, num_blocks)
            known = 0 if new else self._lens[slot]
            if new:
                self.tables_SN[slot, len(table) :] = SINK_BLOCK
            if len(table) > known:
                self.tables_SN[slot, known : len(table)] = torch.tensor(table[known:])
            self._lens[slot] = len(table)

    def on_device(self, slots: list[int], num_tokens: int, device: torch.device) -> torch.Tensor:
        """The slots' tables as (B, blocks for num_tokens + 1) on `device`.

        NOTE: one column more than the tokens need: a compiled prefill's first tables were one
        block wide, and torch.compile specializes a size-1 dimension (a compile for each)."""
        num = min(blocks_for(num_tokens, self.block_size) + 1, self.max_blocks)
        return to_device(self.tables_SN[torch.tensor(slots), :num], device)

    def fork_copies(self, slots: list[int], num_tokens: int) -> list[tuple[int, int]]:
        """(source, destination) blocks that give slots[1:] the first `num_tokens` of slots[0]:
        those of their tables that differ from slots[0]'s (their own last, partial block)."""
        num = blocks_for(num_tokens, self.block_size)
        source = self.tables_SN[slots[0], :num].tolist()
        return [
            (src, dst)
            for slot in slots[1:]
            for src, dst in zip(source, self.tables_SN[slot, :num].tolist(), strict=True)
            if src != dst
        ]
