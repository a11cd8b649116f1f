"""The KV block pool's bookkeeping: which blocks are free, and how many tables hold each one.
Pure Python; the runner owns the storage (areno/engine/layers/cache.py).

Block ids run 1..num_blocks: block 0 of the storage is a sink that no sequence owns, where the
padded rows of a batched step (a CUDA-graph bucket's idle rows, a padded prefill's pads) write
what nobody reads. A block held by several tables (the n samples of one prompt share its full
blocks) is freed when the last of them lets it go.

Prefix caching: a full block that was computed can be registered under its prefix hash
(`block_hashes`: chained over every earlier block, its token ids and the media items behind its
placeholders). Freed, it stays cached, evicted least-recently-freed first when nothing uncached
is free, so a later sequence with the same prefix takes it again (`lookup`, `acquire`) instead
of computing it.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
from array import array
from collections.abc import Sequence

SINK_BLOCK = 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    media: Sequence[tuple[int, int, str]] = (),
    parent: bytes = b"",
) -> list[bytes]:
    """The prefix hash of each full block of `token_ids`: block i's chains block i-1's (the
    first `parent`'s, a prefix's computed elsewhere), its token ids, and the key of every media
    item whose span (start, end, key) overlaps it, with the span's place, so that two different
    images behind the same placeholder ids never share a block. 128-bit BLAKE2b: a collision
    would hand one prompt another's keys, so Python's 64-bit `hash` is not enough."""
    hashes = []
    previous = parent
    for first in range(0, len(token_ids) - block_size + 1, block_size):
        last = first + block_size
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(array("q", token_ids[first:last]).tobytes())
        _hash_media(h, media, first, last)
        previous = h.digest()
        hashes.append(previous)
    return hashes


def chain_root(adapter: str | None) -> bytes:
    """The parent of a prompt's first block hash: the keys of a LoRA adapter's requests are not
    the base model's (nor another adapter's), so each adapter has its own hash chains."""
    return b"" if adapter is None else b"lora:" + adapter.encode()


def partial_block_hash(
    token_ids: Sequence[int], media: Sequence[tuple[int, int, str]] = (), parent: bytes = b""
) -> bytes:
    """The hash of a block that holds only `token_ids` (fewer than a block's), after the full
    blocks whose last hash is `parent`: where a finished sequence's state resumes
    (areno/engine/kv/state_cache.py). Never equal to a full block's (`block_hashes`)."""
    h = hashlib.blake2b(b"partial:" + parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    _hash_media(h, media, 0, len(token_ids))
    return h.digest()


def _hash_media(h, media: Sequence[tuple[int, int, str]], first: int, last: int) -> None:
    """Hash the media items that overlap tokens first..last-1, each with its place relative to
    `first` (the same block hashes the same wherever the hashing of a sequence started)."""
    for start, end, key in media:
        if start < last and end > first:
            h.update(f"|{start - first}:{end - first}:{key}".encode())


class BlockManager:
    """Free blocks (the lowest id goes first, so runs are deterministic), reference counts, and
    the prefix cache's blocks by hash (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks; got {num_blocks} of {block_size} tokens")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(1, num_blocks + 1))  # already a valid min-heap
        self._refs = [0] * (num_blocks + 1)
        self._cached: dict[bytes, int] = {}  # prefix hash -> the block that holds it
        self._hash_of: dict[int, bytes] = {}
        # Cached blocks nobody holds, least recently freed first: evicted in this order.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks an `allocate` may take: the free ones and the cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered under a prefix hash, held or not."""
        return len(self._cached)

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_free

    def allocate(self, num: int) -> list[int]:
        """`num` free blocks, each with one reference: uncached ones first, then cached ones
        nobody holds, least recently freed first (their hashes forgotten)."""
        if not self.can_allocate(num):
            raise RuntimeError(f"asked for {num} blocks with only {self.num_free} free")
        blocks = [heapq.heappop(self._free) for _ in range(min(num, len(self._free)))]
        while len(blocks) < num:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
            blocks.append(block)
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def register(self, block: int, prefix_hash: bytes) -> None:
        """Cache a held, computed, full block under its prefix hash. A hash cached already (the
        same prefix computed twice at once) keeps its first block; a block keeps its first
        hash (its contents never change while it is cached)."""
        assert self._refs[block] > 0, f"block {block} is not allocated"
        if prefix_hash in self._cached or block in self._hash_of:
            return
        self._cached[prefix_hash] = block
        self._hash_of[block] = prefix_hash

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `hashes` from the first (not yet held: see
        `acquire`)."""
        blocks = []
        for prefix_hash in hashes:
            block = self._cached.get(prefix_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, blocks: list[int]) -> list[int]:
        """One more reference to each cached block of `lookup`, held or not."""
        for block in blocks:
            assert block in self._hash_of, f"block {block} is not cached"
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        return list(blocks)

    def share(self, blocks: list[int]) -> list[int]:
        """One more reference to each of `blocks` (a forked table holds them too)."""
        for block in blocks:
            assert self._refs[block] > 0, f"block {block} is not allocated"
            self._refs[block] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds is free again. A table's blocks
        are let go from its last: its cached tail is evicted before the head it extends (a
        head evicted first would leave the tail unreachable)."""
        for block in reversed(blocks):
            if self._refs[block] <= 0:
                raise RuntimeError(f"block {block} is not allocated (double free?)")
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of:
                self._evictable[block] = None  # cached still; the newest freed is evicted last
            else:
                heapq.heappush(self._free, block)

    def forget_cached(self) -> None:
        """Drop every hash (new weights make the cached keys stale): cached blocks nobody holds
        are free, held ones are their tables' alone."""
        for block in self._evictable:
            heapq.heappush(self._free, block)
        self._evictable.clear()
        self._cached.clear()
        self._hash_of.clear()

    def num_refs(self, block: int) -> int:
        return self._refs[block]
