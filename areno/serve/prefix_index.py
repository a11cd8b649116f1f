"""The prefix router's books and choice (areno/serve/routing.py routes with them): which
prompt blocks each Generator replica was sent, and which replica a request goes to. Pure
Python; no Ray.
"""

from __future__ import annotations

import collections
import random
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from areno.engine.kv.block_manager import block_hashes, chain_root
from areno.engine.sequence import media_keys

# The prompt's first blocks the prefix router hashes (4,096 tokens at the default block size):
# chats and groups that share more than that share it all, and a long prompt's hashing stays
# under a millisecond of the Ingress.
MAX_ROUTED_BLOCKS = 256
# Blocks the index remembers per replica, least recently sent forgotten first: 2M tokens at
# the default block size, more than a replica's pool holds on CPU or a single GPU.
INDEX_BLOCKS_PER_REPLICA = 1 << 17
# The Generator methods whose first argument is a prompt the engine prefills.
PROMPT_METHODS = ("generate", "generate_all")
_rng = random.Random()


class PrefixIndex:
    """The prompt blocks each replica was sent, by prefix hash: a chain of hashes sent to a
    replica is (approximately) a prefix its cache holds. Shared by the routers of one process
    (the Ingress's streaming and unary handles each have one), hence the lock."""

    def __init__(self, capacity: int = INDEX_BLOCKS_PER_REPLICA) -> None:
        self.capacity = capacity
        self._blocks: dict[Hashable, collections.OrderedDict[bytes, None]] = {}
        self._lock = threading.Lock()

    def matches(self, hashes: Sequence[bytes], replicas: Sequence[Hashable]) -> dict:
        """Each replica's number of leading `hashes` it was sent."""
        with self._lock:
            counts = {}
            for replica in replicas:
                held = self._blocks.get(replica, {})
                n = 0
                while n < len(hashes) and hashes[n] in held:
                    n += 1
                counts[replica] = n
            return counts

    def insert(self, replica: Hashable, hashes: Sequence[bytes]) -> None:
        with self._lock:
            held = self._blocks.setdefault(replica, collections.OrderedDict())
            for h in hashes:
                held[h] = None
                held.move_to_end(h)
            while len(held) > self.capacity:
                held.popitem(last=False)

    def keep_only(self, replicas: Sequence[Hashable]) -> None:
        """Forget replicas that are gone (a replacement starts with an empty cache)."""
        with self._lock:
            for replica in set(self._blocks) - set(replicas):
                del self._blocks[replica]


def choose(
    matches: dict, loads: dict, num_blocks: int, max_imbalance: int, rng: random.Random = _rng
) -> Hashable:
    """The replica for a request of `num_blocks` hashed blocks, from each replica's matched
    blocks and requests in flight: the least busy of those holding its longest prefix, if it
    is at most `max_imbalance` requests busier than the least busy replica, scaled by the share
    of the prompt its match saves over that one's (a shared system prompt of a fifth of the
    prompt buys a fifth of the imbalance; a chat's history, most of it). Otherwise, or when
    nothing matched, the less busy of two random replicas (Serve's power of two choices), the
    longer match first between equally busy ones."""
    longest = max(matches.values(), default=0)
    if longest > 0:
        holders = [r for r in loads if matches[r] == longest]
        pick = min(rng.sample(holders, len(holders)), key=loads.__getitem__)
        least = min(loads.values())
        idle_match = max(matches[r] for r in loads if loads[r] == least)
        saved = (longest - idle_match) / max(num_blocks, longest)
        if loads[pick] - least <= max_imbalance * saved:
            return pick
    two = rng.sample(list(loads), min(2, len(loads)))
    return min(two, key=lambda r: (loads[r], -matches[r]))


def prompt_hashes(method: str, args: Sequence[Any], block_size: int) -> list[bytes]:
    """The prefix hashes of the first full blocks of a Generator call's prompt (`method` and
    its positional `args`), as its engine keys them; none for a call without a prompt (stats,
    score, pause)."""
    if method not in PROMPT_METHODS:
        return []
    args = list(args) + [None, None]
    inputs, params = args[0], args[1]
    token_ids = getattr(inputs, "input_ids", None)
    if not token_ids:
        return []
    tokens = token_ids[: MAX_ROUTED_BLOCKS * block_size]
    media = media_keys(getattr(inputs, "mm_spans", []))
    return block_hashes(tokens, block_size, media, chain_root(getattr(params, "adapter", None)))


# One index and one turn counter per deployment and process, shared by its handles' routers.
_shared: dict[tuple[str, Any], Any] = {}
_shared_lock = threading.Lock()


def per_deployment(kind: str, deployment: Any, make: Callable[[], Any]) -> Any:
    """The process's one `kind` object of `deployment`, made on first use. Here, not in
    routing.py: Serve pickles a router's module by value, so each handle's router would
    otherwise get globals of its own."""
    with _shared_lock:
        if (kind, deployment) not in _shared:
            _shared[kind, deployment] = make()
        return _shared[kind, deployment]
