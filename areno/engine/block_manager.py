"""The KV block pool's bookkeeping: which blocks are free, and how many tables hold each one.
Pure Python; the runner owns the storage (areno/engine/cache.py).

Block ids run 1..num_blocks: block 0 of the storage is a sink that no sequence owns, where the
padded rows of a batched step (a CUDA-graph bucket's idle rows, a padded prefill's pads) write
what nobody reads. A block held by several tables (the n samples of one prompt share its full
blocks) is freed when the last of them lets it go.
"""

from __future__ import annotations

import heapq

SINK_BLOCK = 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Free blocks (the lowest id goes first, so runs are deterministic) and reference counts."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks; got {num_blocks} of {block_size} tokens")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(1, num_blocks + 1))  # already a valid min-heap
        self._refs = [0] * (num_blocks + 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        """`num` free blocks, each with one reference."""
        if not self.can_allocate(num):
            raise RuntimeError(f"asked for {num} blocks with only {self.num_free} free")
        blocks = [heapq.heappop(self._free) for _ in range(num)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> list[int]:
        """One more reference to each of `blocks` (a forked table holds them too)."""
        for block in blocks:
            assert self._refs[block] > 0, f"block {block} is not allocated"
            self._refs[block] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds is free again."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise RuntimeError(f"block {block} is not allocated (double free?)")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                heapq.heappush(self._free, block)

    def num_refs(self, block: int) -> int:
        return self._refs[block]
