"""The KV manager: every sequence's cache slot, KV blocks and saved states, and the prefix cache
over them, behind what the scheduler asks. Pure Python; the runner holds the tensors.

The scheduler sees sequences and counts: the cached prefix a waiting sequence would start from
(`lookup`), whether it fits (`can_admit`), its admission (`admit`, or `join` for a sample that
shares its group's prefill), the blocks a decoding sequence grows by (`grow`), the state saves a
prefill must make (`take_saves_of`, `take_saves`), and `release`. The books behind it:
`SlotAllocator` (slots: a row of per-sequence state each), `BlockManager` (blocks, reference
counts, prefix hashes), `StateCache` (saved linear-attention / sliding-ring states), and the
`PrefixCache` policy of what is registered, found and saved.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from areno.engine.kv.block_manager import BlockManager, blocks_for
from areno.engine.kv.prefix_cache import PrefixCache
from areno.engine.kv.state_cache import ResumePoint, StateCache
from areno.engine.sequence import Sequence, SequenceGroup


class SlotAllocator:
    """Cache slot ids 0..num_slots-1; the lowest free slot goes first, so slots in use stay
    packed at the front (deterministic for tests; a runner may slice the cache by the max slot)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # already a valid min-heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        """`num` free slots, lowest first."""
        if not self.can_allocate(num):
            raise RuntimeError(f"asked for {num} slots with only {self.num_free} free")
        slots = [heapq.heappop(self._free) for _ in range(num)]
        self._used.update(slots)
        return slots

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"slot {slot} is not allocated (double free?)")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)


@dataclass
class CachedPrefix:
    """What the prefix cache holds of a waiting sequence's first tokens: its cached blocks
    (not yet taken) and, where the model keeps states, the resume point they end at."""

    blocks: list[int] = field(default_factory=list)
    point: ResumePoint | None = None
    block_size: int = 1
    # The full blocks of its prompt found cached in all, beyond the resume point too (a prefix
    # shared with an earlier prompt whose state was not saved where they part).
    num_matched_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        """The prompt tokens it covers: the prefill starts after them."""
        return (
            self.point.num_tokens if self.point is not None else len(self.blocks) * self.block_size
        )


@dataclass
class Admission:
    """What a sequence's admitted prefill must do before its tokens: restore a saved state row
    into its slot and copy a block (a resume point's tail). Its state saves, if any, come from
    `take_saves_of`."""

    restore_row: int | None = None
    copy_block: tuple[int, int] | None = None


class KVCacheManager:
    """Slots, blocks, saved states and the prefix cache of one engine; see the module docstring."""

    def __init__(
        self,
        *,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_state_rows: int,
        groups: dict[str, SequenceGroup],
        saves_text_prompts: bool = False,
        checkpoint_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.slots = SlotAllocator(num_slots)
        self.blocks = BlockManager(num_blocks, block_size)
        self.prefix = PrefixCache(
            enable_prefix_caching,
            self.blocks,
            num_state_rows,
            groups,
            saves_text_prompts,
            checkpoint_blocks,
        )

    @property
    def states(self) -> StateCache:
        return self.prefix.states

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    @property
    def num_used_slots(self) -> int:
        return self.slots.num_used

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    def can_allocate_slot(self) -> bool:
        return self.slots.can_allocate(1)

    # ---- running sequences ---------------------------------------------------------------

    def blocks_to_grow(self, seq: Sequence) -> int:
        """Blocks `seq` needs beyond its own to write the token it feeds this step."""
        return blocks_for(seq.next_position + 1, self.block_size) - len(seq.block_ids)

    def can_grow(self, num_blocks: int) -> bool:
        return self.blocks.can_allocate(num_blocks)

    def grow(self, seq: Sequence, num_blocks: int) -> None:
        seq.block_ids += self.blocks.allocate(num_blocks)

    def register(self, running: list[Sequence]) -> None:
        """Register the blocks running sequences have filled since the last step."""
        if self.caching:
            for seq in running:
                self.prefix.register(seq)

    def save_last_states(self, running: list[Sequence], may_decode: Callable) -> None:
        """Save the end state of running sequences that do not decode again (`PrefixCache`)."""
        if self.states.num_rows:
            self.prefix.save_last_states(running, may_decode)

    def new_step(self) -> None:
        """A step is being scheduled (the last one's state saves are launched)."""
        self.prefix.new_step()

    def take_saves(self) -> list[tuple[int, int]]:
        """The (slot, row) end-state saves planned for the step about to run."""
        return self.prefix.take_saves()

    def take_saves_of(self, seq: Sequence, start: int, end: int) -> list[tuple[int, int]]:
        """`seq`'s planned state saves, (position, row), that a prefill of its tokens `start`
        to `end` reaches."""
        return self.prefix.take_saves_of(seq, start, end)

    # ---- admission -----------------------------------------------------------------------

    def awaits(self, seq: Sequence, group: SequenceGroup, running: list[Sequence]) -> bool:
        """Whether a running sequence is computing what `seq` would find cached (then it waits)."""
        return self.prefix.awaits(seq, group, running)

    def lookup(self, seq: Sequence, group: SequenceGroup) -> CachedPrefix:
        blocks, point, matched = self.prefix.lookup(seq, group)
        return CachedPrefix(blocks, point, self.block_size, matched)

    def can_admit(self, num_blocks: int, cached: CachedPrefix | None, reserve: int) -> bool:
        """Whether `num_blocks` new blocks and the cached ones fit with `reserve` blocks left:
        cached blocks nobody holds count as free until the sequence takes them."""
        held = cached.blocks if cached is not None else []
        taken = num_blocks + sum(1 for block in held if self.blocks.num_refs(block) == 0)
        return self.blocks.num_free - taken >= reserve

    def admit(
        self, seq: Sequence, group: SequenceGroup, cached: CachedPrefix, num_blocks: int
    ) -> Admission:
        """Give `seq` a slot, the cached blocks and `num_blocks` new ones; plan the state save
        its prompt makes. Returns what its prefill does besides its tokens."""
        self._take_slot(seq)
        # NOTE: the tail block's copy runs before any prefill of the step writes a block, so
        # it may be evicted below, even into this table.
        point = cached.point
        tail = point and point.tail_hash and self.blocks.lookup([point.tail_hash])[0]
        seq.block_ids = self.blocks.acquire(cached.blocks) + self.blocks.allocate(num_blocks)
        admission = Admission()
        if point is not None:
            admission.restore_row = point.row
        if tail:
            admission.copy_block = (tail, seq.block_ids[len(cached.blocks)])
        seq.num_registered_blocks = len(cached.blocks)
        self.prefix.plan_prompt_saves(seq, group, cached.num_tokens, cached.num_matched_blocks)
        return admission

    def join(self, seq: Sequence, leader: Sequence, num_shared: int, num_blocks: int) -> None:
        """Admit a new sample of `leader`'s group into `leader`'s prefill: its first
        `num_shared` full blocks shared, `num_blocks` of its own."""
        self._take_slot(seq)
        shared = self.blocks.share(leader.block_ids[:num_shared])
        seq.block_ids = shared + self.blocks.allocate(num_blocks)

    def _take_slot(self, seq: Sequence) -> None:
        seq.slot = self.slots.allocate(1)[0]
        self.prefix.stamp(seq)

    # ---- leaving -------------------------------------------------------------------------

    def release(self, seq: Sequence) -> None:
        """Free `seq`'s slot and blocks (a finished sequence's end state saved, its blocks left
        cached); a preempted sequence comes back through admission."""
        for point in seq.state_saves:  # its prefill never reached them
            self.states.discard(point)
        seq.state_saves = []
        if self.states.num_rows and seq.finish_reason in ("stop", "length") and not seq.end_saved:
            self.prefix.save_end_state(seq)
        if self.caching and seq.block_ids:
            self.prefix.register(seq)  # its blocks stay cached once freed
        seq.num_registered_blocks = 0
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None
        self.blocks.free(seq.block_ids)
        seq.block_ids = []

    def forget(self, running: list[Sequence]) -> None:
        """Forget every cached block and saved state (new weights make them stale)."""
        self.prefix.forget(running)
