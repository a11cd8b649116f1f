"""The prefix cache's policy: which blocks a sequence registers, where a prompt starts from
(cached blocks, and on models that keep layer state a saved resume point), and when states are
saved. Pure Python over request state; the scheduler calls it (areno/engine/core/scheduler.py), the
block manager and the state cache hold its books (block_manager.py, state_cache.py).

See docs/architecture.md ("Prefix caching") for what is saved where and in what order.
"""

from __future__ import annotations

from areno.engine.kv.block_manager import (
    BlockManager,
    block_hashes,
    chain_root,
    partial_block_hash,
)
from areno.engine.kv.state_cache import ResumePoint, StateCache
from areno.engine.sequence import Sequence, SequenceGroup


class PrefixCache:
    """Registration, lookups and state saves of the prefix cache (see the module docstring)."""

    def __init__(
        self,
        enabled: bool,
        blocks: BlockManager,
        num_state_rows: int,
        groups: dict[str, SequenceGroup],
        saves_text_prompts: bool = False,
        checkpoint_blocks: int = 0,
    ) -> None:
        self.enabled = enabled
        self.saves_text_prompts = saves_text_prompts
        self.checkpoint_blocks = checkpoint_blocks
        self.blocks, self.block_size = blocks, blocks.block_size
        self.states = StateCache(num_state_rows if enabled else 0)
        self.groups = groups  # the scheduler's unfinished requests, by id
        self._epoch = 0  # weights forgotten so far (`forget`)
        self._saves: list[tuple[int, int]] = []
        # Planned points the step being scheduled saves (pinned until the next step).
        self._saving: list[ResumePoint] = []

    def new_step(self) -> None:
        """A step is being scheduled: the saves of the last one are launched, so their points
        may be resumed from (a restore runs after them, in launch order)."""
        for point in self._saving:
            self.states.unpin(point)
        self._saving = []

    def take_saves(self) -> list[tuple[int, int]]:
        """The (slot, row) end-state saves planned so far, for the step about to run."""
        saves, self._saves = self._saves, []
        return saves

    def stamp(self, seq: Sequence) -> None:
        """Mark `seq`'s keys as computed with the current weights (at admission)."""
        seq.cache_epoch = self._epoch

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The prefix hashes of `seq`'s first `num_blocks` full blocks (kept on it as they are
        first needed)."""
        known, size = len(seq.block_hashes), self.block_size
        if num_blocks > known:
            start = known * size
            media = [
                (first - start, last - start, key)
                for first, last, key in self.groups[seq.request_id].media_keys()
            ]
            parent = seq.block_hashes[-1] if known else _root(seq)
            tokens = seq.token_ids[start : num_blocks * size]
            seq.block_hashes += block_hashes(tokens, size, media, parent)
        return seq.block_hashes[:num_blocks]

    def _tail_hash(self, seq: Sequence, num_tokens: int) -> bytes:
        """The `partial_block_hash` of `seq`'s tokens after its last full block before
        `num_tokens`, up to it."""
        first = num_tokens // self.block_size * self.block_size
        media = [
            (a - first, b - first, key) for a, b, key in self.groups[seq.request_id].media_keys()
        ]
        parent = self.hashes(seq, first // self.block_size)[-1] if first else _root(seq)
        return partial_block_hash(seq.token_ids[first:num_tokens], media, parent)

    def register(self, seq: Sequence, computed: int | None = None) -> None:
        """Register the full blocks of `seq` whose keys earlier steps wrote (launched steps
        run in order: a later step reading them runs after); `computed`: its first tokens
        whose keys are written (default: what its prefill and decodes have reached)."""
        if computed is None and _is_prefilling(seq):
            computed = seq.num_computed_tokens
        elif computed is None:
            computed = min(seq.next_position, seq.num_tokens)
        if seq.cache_epoch != self._epoch:
            return  # its keys are partly the old weights'
        full = min(computed // self.block_size, len(seq.block_ids))
        if full <= seq.num_registered_blocks:
            return
        hashes = self.hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.blocks.register(seq.block_ids[i], hashes[i])
        seq.num_registered_blocks = full

    def lookup(
        self, seq: Sequence, group: SequenceGroup
    ) -> tuple[list[int], ResumePoint | None, int]:
        """The prefix cache's blocks for `seq`'s first tokens (not yet held), leaving at least
        its last token to prefill (its logits sample the first new token), never ending inside
        a run the group holds whole; where the model keeps states, only up to the longest
        saved resume point (`StateCache`), which is returned too; and how many of its full
        blocks were found cached in all (past that point too)."""
        if not (self.enabled and group.can_chunk):
            return [], None, 0
        size, limit = self.block_size, seq.num_tokens - 1
        hashes = self.hashes(seq, limit // size)
        blocks = self.blocks.lookup(hashes)
        if not self.states.num_rows:
            while blocks and inside_run(group, len(blocks) * size):
                blocks.pop()
            return blocks, None, len(blocks)
        for k in range(len(blocks), -1, -1):
            best = None
            for point in self.states.after(hashes[k - 1] if k else _root(seq)):
                end = point.num_tokens
                if end > limit or inside_run(group, end) or self.states.is_pinned(point):
                    continue
                if best is not None and best.num_tokens >= end:
                    continue
                if point.tail_hash is not None and (
                    point.tail_hash != self._tail_hash(seq, end)
                    or not self.blocks.lookup([point.tail_hash])
                ):
                    continue
                best = point
            if best is not None:
                self.states.resume(best)
                return blocks[:k], best, len(blocks)
        return [], None, len(blocks)

    def awaits(self, seq: Sequence, group: SequenceGroup, running: list[Sequence]) -> bool:
        """Whether a running sequence is computing `seq`'s prompt up to its last full block,
        which the prefix cache gives `seq` once that is done (a step or so): then `seq` waits
        for it rather than computing it again (the samples of a GRPO group, sent as requests
        of their own, share one prefill so)."""
        if not self.enabled or not group.can_chunk:
            return False
        if self.states.num_rows and not (group.media_keys() or self.saves_text_prompts):
            return False  # no state is saved at its prompt's end (`plan_prompt_saves`)
        num_blocks = (seq.num_tokens - 1) // self.block_size
        if not num_blocks:
            return False
        key = self.hashes(seq, num_blocks)[-1]
        return any(
            other.cache_epoch == self._epoch
            and other.num_registered_blocks < num_blocks
            and len(other.block_hashes) >= num_blocks
            and other.block_hashes[num_blocks - 1] == key
            for other in running
        )

    def plan_prompt_saves(
        self, seq: Sequence, group: SequenceGroup, cached: int, matched_blocks: int
    ) -> None:
        """Where the model keeps states, have `seq`'s prefill save them past `cached` (its
        resume point): at the end of its prompt's last full block (before its last token), so
        that the same prompt again resumes there (a retried request, a GRPO group's samples);
        every `checkpoint_blocks` blocks, so that a prompt sharing only its beginning (a system
        prompt, an agent's tools) resumes near where the two part; and at the end of the
        `matched_blocks` it found cached past its resume point, where it parts from an earlier
        prompt (a third one with that beginning resumes exactly there). Its prefill runs in
        parts around the saves (`runner/prefills.py`). Prompts with media always; text prompts
        where `saves_text_prompts` (the parts run as a whole prompt does, compiled or not; not
        where only a whole prompt's forward is compiled). The deepest saves are planned first,
        at most half the saved-state rows; one no row can be had for is skipped."""
        size = self.block_size
        last = (seq.num_tokens - 1) // size * size
        saves = group.media_keys() or self.saves_text_prompts
        if not (self.states.num_rows and saves) or last <= cached:
            return
        ends = {e for e in (last, min(matched_blocks * size, last)) if e > cached}
        if self.checkpoint_blocks:
            # Every checkpoint_blocks blocks below the saves above, each a round of the prefill.
            step = self.checkpoint_blocks * size
            ends.update(range(step, min(ends) - step + 1, step))
        points = []
        # Deepest first, at most half the rows: one long prompt leaves the other half of the
        # saved states (other prompts' points, turns' ends) to the least recently used.
        for end in sorted((e for e in ends if e > cached), reverse=True):
            if len(points) == max(1, self.states.num_rows // 2):
                break
            if inside_run(group, end):
                continue
            point = self.states.add(self.hashes(seq, end // size)[-1], end, None, pinned=True)
            if point is not None:
                points.append(point)
        seq.state_saves = points[::-1]

    def take_saves_of(self, seq: Sequence, start: int, end: int) -> list[tuple[int, int]]:
        """`seq`'s planned state saves, (position, row) by position, that a prefill of its
        tokens `start` to `end` reaches (they are then the prefill's to make)."""
        taken = [p for p in seq.state_saves if start < p.num_tokens <= end]
        if not taken:
            return []
        seq.state_saves = [p for p in seq.state_saves if not start < p.num_tokens <= end]
        self._saving += taken
        self.states.num_saves += len(taken)
        return [(point.num_tokens, point.row) for point in taken]

    def save_end_state(self, seq: Sequence) -> None:
        """Save the state of a sequence that ended, after every token it fed: where the next
        turn (its tokens and more) resumes. Its blocks are registered, the last partial one
        under its `partial_block_hash`."""
        end = seq.num_fed_tokens
        group = self.groups.get(seq.request_id)
        if group is None or not end or seq.slot is None or inside_run(group, end):
            return
        if seq.cache_epoch != self._epoch:
            return
        size = self.block_size
        self.register(seq, end)
        tail = None
        if end % size:
            tail = self._tail_hash(seq, end)
            self.blocks.register(seq.block_ids[end // size], tail)
        parent = self.hashes(seq, end // size)[-1] if end >= size else _root(seq)
        point = self.states.add(parent, end, tail)
        if point is not None:
            self._saves.append((seq.slot, point.row))
            self.states.num_saves += 1

    def save_last_states(self, running: list[Sequence], may_decode) -> None:
        """Save now the end state of each running sequence whose in-flight token is its last
        (it does not decode this step, `_may_decode`): by the time the host reads that token,
        this step's padded decode may have written over its idle slot."""
        for seq in running:
            if seq.end_saved or _is_prefilling(seq) or may_decode(seq):
                continue
            self.save_end_state(seq)
            seq.end_saved = True

    def forget(self, running: list[Sequence]) -> None:
        """Forget every cached block and saved state (new weights make them stale)."""
        self.blocks.forget_cached()
        self.states.clear()
        self._saves = []
        self._saving = []
        self._epoch += 1  # running sequences keep their keys but never cache them
        for seq in running:
            seq.state_saves = []  # their rows may go to new points


def _root(seq: Sequence) -> bytes:
    """The parent of a sequence's first block hash (its adapter's chains, `chain_root`)."""
    return chain_root(seq.params.adapter)


def _is_prefilling(seq: Sequence) -> bool:
    return seq.num_computed_tokens < seq.prefill_end


def inside_run(group: SequenceGroup, position: int) -> bool:
    """Whether `position` falls inside a run the group holds whole (a cut there would split it)."""
    return any(start < position < end for start, end in group.whole_runs)
