"""Request state the scheduler works on: one `Sequence` per sample, one `SequenceGroup` per request.

A request with `n` samples is a group of n sequences sharing one prompt. Samples admitted in the
same step share one prefill: the prompt's full KV blocks are shared and each sample gets its own
copy of the last, partial one; later each sequence decodes on its own. A sample admitted later
(the slots were busy) or resumed after a preemption prefills its own tokens again.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from areno.engine.sampling import MAX_SEED, SamplingParams

# Process-wide counters: ids stay unique and arrivals ordered across every scheduler.
_next_seq_id = itertools.count()
_next_arrival = itertools.count()


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: waiting for a slot (new, or preempted), running, or
    finished (and why)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        """Whether the sequence will produce no more tokens."""
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason ("stop", "length", "abort"), or None while unfinished."""
        return _FINISH_REASONS.get(self)

    @classmethod
    def finished_for(cls, reason: str) -> SequenceStatus:
        """The finished status for a reason string ("stop", "length" or "abort")."""
        for status, status_reason in _FINISH_REASONS.items():
            if status_reason == reason:
                return status
        raise ValueError(f"unknown finish reason {reason!r}; expected stop, length or abort")


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


# NOTE: eq=False: sequences are compared by identity, never by their (possibly equal) token lists.
@dataclass(eq=False)
class Sequence:
    """One sample of a request: its prompt, the tokens generated so far, its cache slot and the
    KV blocks its tokens are in."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_index: int = 0
    seq_id: int = field(default_factory=lambda: next(_next_seq_id))
    arrival: int = field(default_factory=lambda: next(_next_arrival))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    block_ids: list[int] = field(default_factory=list)
    # The tokens its admission's prefill covers, and how many of them the prefills scheduled so
    # far write: below `prefill_end` while a long prompt is prefilled in chunks (scheduler.py).
    prefill_end: int = 0
    num_computed_tokens: int = 0
    # The prefix hashes of its full blocks known so far, and how many of its blocks are
    # registered in the prefix cache (scheduler.py).
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Positions whose keys (and state) the steps launched so far write, and the resume points its
    # prefill saves the state at, by position, as its chunks reach them
    # (areno/engine/kv/state_cache.py).
    num_fed_tokens: int = 0
    state_saves: list[Any] = field(default_factory=list)
    end_saved: bool = False  # its state after its last fed token is saved already
    # The weights its keys were computed with (Scheduler.forget_cached counts them): keys and
    # states of older weights are never cached.
    cache_epoch: int = 0
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Tokens sampled on the device that the host has not read yet (0 or 1: an overlapped step
    # runs while the previous one's tokens are read; see areno/engine/core/engine_core.py).
    num_in_flight: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the context length this sequence occupies."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def next_position(self) -> int:
        """The cache position of the next token fed to the model (its in-flight token's, when
        there is one)."""
        return self.num_tokens + self.num_in_flight - 1

    @property
    def token_ids(self) -> list[int]:
        """Prompt plus generated tokens: what a resumed (preempted) sequence prefills again."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The token the next decode step feeds to the model."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def seed(self) -> int | None:
        """This sample's seed: `params.seed + sample_index`, so the n samples of a seeded request
        differ from each other yet each is reproducible (the convention vLLM uses)."""
        if self.params.seed is None:
            return None
        return (self.params.seed + self.sample_index) % (MAX_SEED + 1)

    def append_token(self, token_id: int) -> None:
        """Record a newly sampled token."""
        assert not self.is_finished, f"sequence {self.seq_id} is finished ({self.status})"
        self.output_token_ids.append(token_id)

    def finish(self, reason: str) -> None:
        """Mark the sequence finished with "stop", "length" or "abort" (its slot and blocks are
        freed by the scheduler's `update` / `cancel`, not here)."""
        self.status = SequenceStatus.finished_for(reason)
        self.finish_reason = reason


@dataclass(eq=False)
class SequenceGroup:
    """The n sequences of one request, sharing one prompt and one arrival time.

    `inputs` is opaque to the scheduler: the engine keeps the request's processor outputs (media
    tensors, positions) there so that prefill can find them, until the last sample finishes (a
    sample admitted late or resumed after a preemption prefills from them again).
    """

    request_id: str
    seqs: list[Sequence]
    inputs: Any = None
    # Whether the prompt may be prefilled in chunks over several steps, and the token runs
    # (start, end) that one chunk must hold whole (the engine sets both: runs the model attends
    # to both ways, as Gemma 4's images in its sliding layers).
    can_chunk: bool = False
    whole_runs: list[tuple[int, int]] = field(default_factory=list)
    # Prompt tokens the scheduler admitted for prefill (again after a preemption; once for
    # samples that share their group's prefill) and, of them, those the prefix cache held.
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0
    # When the engine took the request, first admitted it, and first read a token of it
    # (time.perf_counter: `RequestTimings`).
    added_at: float = field(default_factory=time.perf_counter)
    scheduled_at: float | None = None
    first_token_at: float | None = None

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        inputs: Any = None,
        can_chunk: bool = False,
        whole_runs: list[tuple[int, int]] | None = None,
    ) -> SequenceGroup:
        """A new waiting group of `params.n` sequences, stamped with the next arrival."""
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; nothing to prefill")
        arrival = next(_next_arrival)
        seqs = [
            Sequence(request_id, list(prompt_token_ids), params, sample_index=i, arrival=arrival)
            for i in range(params.n)
        ]
        return cls(request_id, seqs, inputs, can_chunk, list(whole_runs or []))

    def media_keys(self) -> list[tuple[int, int, str]]:
        """(start, end, key) of each media item of the prompt, as `block_hashes` takes them.
        NOTE: the key is the item's content hash (its source bytes and every decoding option
        that shaped it: the same clip at another fps is another item), modality and feature
        count."""
        return media_keys(self.inputs.mm_spans if self.inputs is not None else [])

    @property
    def params(self) -> SamplingParams:
        return self.seqs[0].params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.seqs[0].num_prompt_tokens

    @property
    def num_seqs(self) -> int:
        """How many sequences (samples) the group has."""
        return len(self.seqs)

    @property
    def arrival(self) -> int:
        return self.seqs[0].arrival

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.is_finished]


def media_keys(spans: list[Any]) -> list[tuple[int, int, str]]:
    """(start, end, key) of each media span (`MediaSpan`) of a prompt, as `block_hashes` takes
    them: the serving router hashes a prompt's blocks as the engine does."""
    return [
        (s.start, s.end, f"{s.modality}:{s.num_placeholder_tokens}:{s.content_hash}") for s in spans
    ]
