"""Which Generator replica a request goes to (`ServeConfig.routing`, `areno serve --routing`),
through Serve's custom request-router API: the GeneratorServer deployment names a router class,
and every handle to it (the Ingress's) routes through an instance of that class.

"prefix" (`PrefixRouter`) sends a prompt to the replica whose prefix cache holds the longest
prefix of it, balanced against the replicas' requests in flight; "round_robin"
(`RoundRobinRouter`) takes the replicas in turn; "power_of_two" is Serve's own router (the less
busy of two random replicas).

The key is the engine's own: the chained hashes of the prompt's first full blocks, media
included (`block_hashes`, `media_keys`, `chain_root`), computed where the request enters from
the token ids the Ingress (or the Processor, for a prompt with media) has already encoded. The
router cannot see the replicas' caches; it keeps an approximate index of what it sent where
(`PrefixIndex`), so a block a replica has since evicted still counts there: that costs a cache
miss, never a wrong answer.
"""

from __future__ import annotations

import itertools

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from areno.serve.prefix_index import PrefixIndex, choose, per_deployment, prompt_hashes


class _ChosenFirst(FIFOMixin):
    """A replica chosen for a request goes to that request; where it is gone (cancelled while
    it waited), to the oldest request still waiting, as Serve's FIFO routers do. With the
    request alone (RequestRouter's own rule), a completions batch whose prompt was refused
    mid-way, its others cancelled while queued here, left every later request unrouted.
    NOTE: it overrides Serve's private `_fulfill_next_pending_request` (ray 2.60, pinned); the
    refused-batch test of tests/serve/live/openai_server runs it under the guarded app."""

    def _fulfill_next_pending_request(self, replica, request_metadata=None) -> None:
        if self._get_pending_request_matching_internal_request_id(request_metadata) is not None:
            RequestRouter._fulfill_next_pending_request(self, replica, request_metadata)
        else:
            FIFOMixin._fulfill_next_pending_request(self, replica, request_metadata)


class PrefixRouter(_ChosenFirst, RequestRouter):
    """Prefix-aware routing (see the module docstring and `choose`)."""

    def initialize_state(self, block_size: int = 16, max_imbalance: int = 8) -> None:
        self.block_size, self.max_imbalance = block_size, max_imbalance
        self.index = per_deployment("index", self._deployment_id, PrefixIndex)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: wait, retry
        candidates = self.select_available_replicas(candidate_replicas) or candidate_replicas
        if not candidates:
            return []
        by_id = {r.replica_id: r for r in candidates}
        hashes = []
        if pending_request is not None:
            method = pending_request.metadata.call_method
            hashes = prompt_hashes(method, pending_request.args, self.block_size)
        matches = self.index.matches(hashes, list(by_id))
        cache = self.replica_queue_len_cache
        loads = {rid: cache.get(rid) or 0 for rid in by_id}  # unknown: idle for a while
        chosen = choose(matches, loads, len(hashes), self.max_imbalance)
        if hashes:
            # Recorded now, not once sent: the requests right behind it with the same prefix
            # (a group's samples, a burst of one chat) follow it instead of splitting.
            self.index.insert(chosen, hashes)
        return [[by_id[chosen]]]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.keep_only([r.replica_id for r in replicas])


class RoundRobinRouter(_ChosenFirst, RequestRouter):
    """The replicas in turn (by id), one request each; a full one is passed over."""

    def initialize_state(self) -> None:
        self.turns = per_deployment("turns", self._deployment_id, itertools.count)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        candidates = self.select_available_replicas(candidate_replicas) or candidate_replicas
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        return [[ordered[next(self.turns) % len(ordered)]]]


ROUTERS = {"prefix": PrefixRouter, "round_robin": RoundRobinRouter}


def request_router_config(
    routing: str, block_size: int, max_imbalance: int
) -> RequestRouterConfig | None:
    """The GeneratorServer's `request_router_config` for a routing policy; None for Serve's
    own ("power_of_two")."""
    if routing not in ROUTERS:
        return None
    router = ROUTERS[routing]
    kwargs = {"block_size": block_size, "max_imbalance": max_imbalance}
    return RequestRouterConfig(
        request_router_class=f"{router.__module__}:{router.__name__}",
        request_router_kwargs=kwargs if routing == "prefix" else {},
    )
