"""Saved slot states, where a later prompt may resume: the prefix cache's half for layers that
keep no per-token keys. Pure Python; the runner owns the storage (areno/engine/layers/cache.py).

Qwen3.5's linear-attention layers hold one conv and one recurrent state per slot, and Gemma 4's
sliding-window layers a ring of their last window of keys: a prompt whose first tokens are
cached in KV blocks still needs those states as they stood after exactly those tokens. The
runner keeps `num_rows` spare rows of them beside the slots'; this class says which rows hold
which resume point, and evicts the least recently used when a new one needs a row.

A resume point is the state after the first `num_tokens` tokens of some sequence: those past
its last full block (the tail, fewer than a block) are named by `partial_block_hash`, and their
keys live in a block registered under that hash. Points are saved
- at the end of a prompt's last full block (after a prefill that stops there), so that another
  request with the same prompt (the samples of a GRPO group) resumes there;
- every `checkpoint_blocks` blocks of a prompt's prefill (PrefixCache), so that a prompt sharing
  only its beginning with an earlier one (a system prompt, a tool preamble) resumes near where
  they part, and at the end of the blocks a prompt found cached beyond its resume point (where
  it parts from an earlier prompt: a third prompt with that beginning resumes exactly there);
- at the end of a finished sequence (every token it fed), so that the next turn of an episode
  or a chat, which sends those tokens and more, prefills only the new ones.
A point is usable while its blocks are cached; its row is reused when it is the least recently
used and a new point needs one. A point a prefill has yet to save is pinned until the step that
saves it is launched: no other point takes its row, and no prompt resumes from it (its
restore would run before the save).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class ResumePoint:
    """The state after `num_tokens` tokens: full blocks up to `parent` (their last block's
    prefix hash, b"" for none), then the tail block `tail_hash` (None when `num_tokens` ends a
    block). `row`: where its state is saved."""

    parent: bytes
    num_tokens: int
    tail_hash: bytes | None
    row: int

    @property
    def key(self) -> tuple[bytes, int, bytes | None]:
        return self.parent, self.num_tokens, self.tail_hash


class StateCache:
    """Which of `num_rows` saved-state rows holds which resume point, least recently used first."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._points: collections.OrderedDict[tuple, ResumePoint] = collections.OrderedDict()
        self._by_parent: dict[bytes, list[ResumePoint]] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._pinned: set[tuple] = set()
        # Prompts resumed from a point, states saved, points evicted for a new one (so far).
        self.num_hits = 0
        self.num_saves = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._points)

    def after(self, parent: bytes) -> list[ResumePoint]:
        """The points that resume right after the full blocks ending in `parent`."""
        return list(self._by_parent.get(parent, ()))

    def touch(self, point: ResumePoint) -> None:
        """Mark `point` used now (evicted last)."""
        self._points.move_to_end(point.key)

    def resume(self, point: ResumePoint) -> None:
        """A prompt resumes from `point`: a hit, and used now."""
        self.num_hits += 1
        self.touch(point)

    def add(
        self, parent: bytes, num_tokens: int, tail_hash: bytes | None, *, pinned: bool = False
    ) -> ResumePoint | None:
        """A row for a new point, evicting the least recently used unpinned one where none is
        free; None when the point is known already (it is touched instead) or no row can be
        had. `pinned`: kept until `unpin` (a save still to be launched)."""
        key = (parent, num_tokens, tail_hash)
        if key in self._points:
            self._points.move_to_end(key)
            return None
        if not self._free_rows:
            oldest = next((p for k, p in self._points.items() if k not in self._pinned), None)
            if oldest is None:
                return None
            self._drop(oldest)
            self.num_evictions += 1
        point = ResumePoint(parent, num_tokens, tail_hash, self._free_rows.pop())
        self._points[key] = point
        self._by_parent.setdefault(parent, []).append(point)
        if pinned:
            self._pinned.add(key)
        return point

    def unpin(self, point: ResumePoint) -> None:
        """Its save is launched: it may be resumed from, its row go to a later point."""
        self._pinned.discard(point.key)

    def is_pinned(self, point: ResumePoint) -> bool:
        return point.key in self._pinned

    def discard(self, point: ResumePoint) -> None:
        """Forget `point` (its state was never saved)."""
        if self._points.get(point.key) is point:
            self._drop(point)

    def _drop(self, point: ResumePoint) -> None:
        del self._points[point.key]
        self._pinned.discard(point.key)
        siblings = self._by_parent[point.parent]
        siblings.remove(point)
        if not siblings:
            del self._by_parent[point.parent]
        self._free_rows.append(point.row)

    def clear(self) -> None:
        """Forget every point (new weights make the saved states stale)."""
        for point in list(self._points.values()):
            self._drop(point)
