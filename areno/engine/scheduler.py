"""The scheduler: which requests run this step. Pure Python over request state; no tensors.

The cache is slot-based: `max_running_seqs` slots, each sized for `max_context_len` tokens and
holding one sequence's KV / recurrent state. A running sequence can therefore always grow to the
context limit, so preemption is never needed for capacity; a sequence that reaches
`max_context_len` finishes with "length" (see `check_stop`). When slots run out, requests wait.

Step contract (one `schedule()` per engine step):
- `prefill`: groups admitted this step, every sequence already holding its own slot. The runner
  runs each prompt once, copies its cache state into the group's n slots, and samples each
  sequence's first token from the prompt's last logits.
- `decode`: every sequence that was running before this step (so it has at least one output
  token). The runner feeds each one's `last_token_id` and samples one token. A group never
  appears in both lists in the same step.
After executing, the engine appends each token, calls `check_stop`, marks finished sequences with
`Sequence.finish`, and hands them to `update` to free their slots before the next `schedule()`.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from areno.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from areno.errors import ArenoError, ConfigError, PromptTooLongError

FLAG_MAX_CONTEXT_LEN = "--max-context-len"
FLAG_MAX_RUNNING = "--max-running-prompts"


class SequenceTooLongError(PromptTooLongError):
    """The prompt leaves no room for a single generated token within max_context_len."""


class TooManySamplesError(ArenoError):
    """A request asks for more samples (n) than the engine has cache slots, so it could never run."""

    code = "too_many_samples"


class DuplicateRequestError(ArenoError):
    """A request id is already waiting or running."""

    code = "duplicate_request_id"


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits.

    max_running_seqs: cache slots, i.e. sequences decoding at once.
    max_context_len: tokens one slot holds (prompt plus output).
    max_prefill_tokens_per_step: prompt tokens admitted per step, so a burst of long prompts does
        not stall running decodes for long; a single prompt over the budget is still admitted
        (alone) so that it never starves.
    """

    max_running_seqs: int
    max_context_len: int
    max_prefill_tokens_per_step: int = 8192

    def __post_init__(self) -> None:
        limits = {
            "max_running_seqs": 1,
            # One prompt token plus one generated token is the least that makes sense.
            "max_context_len": 2,
            "max_prefill_tokens_per_step": 1,
        }
        for name, least in limits.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(
                    f"SchedulerConfig.{name} must be an integer >= {least}; got {value!r}",
                    param=name,
                )


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
class SchedulerOutput:
    """What to run this step; see the module docstring for the prefill / decode contract.

    num_waiting / num_running count sequences (slot units) after this step's admission.
    """

    prefill: list[SequenceGroup]
    decode: list[Sequence]
    num_waiting: int
    num_running: int

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_prefill_tokens(self) -> int:
        return sum(group.num_prompt_tokens for group in self.prefill)


class Scheduler:
    """FCFS admission of waiting groups into free cache slots; running groups decode each step."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.slots = SlotAllocator(config.max_running_seqs)
        self._waiting: list[SequenceGroup] = []  # sorted by arrival
        self._running: dict[str, SequenceGroup] = {}  # in admission order
        self.hold_admission = False

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a slot."""
        return sum(group.num_seqs for group in self._waiting)

    @property
    def num_running(self) -> int:
        """Sequences holding a slot."""
        return self.slots.num_used

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running (the engine loop may sleep when not)."""
        return bool(self._waiting or self._running)

    def add(self, group: SequenceGroup) -> None:
        """Queue a new request; it runs once slots free up (requests are never dropped).

        Raises SequenceTooLongError, TooManySamplesError or DuplicateRequestError for a request
        that could never run, so it fails at once instead of waiting forever.
        """
        self.check_fits(group.num_prompt_tokens, group.num_seqs)
        if group.request_id in self._running or any(
            g.request_id == group.request_id for g in self._waiting
        ):
            raise DuplicateRequestError(f"request id {group.request_id!r} is already in use")
        bisect.insort(self._waiting, group, key=lambda g: g.arrival)

    def check_fits(self, num_prompt_tokens: int, num_seqs: int) -> None:
        """Raise for a request that could never run (see `add`)."""
        limit = self.config.max_context_len
        if num_prompt_tokens >= limit:
            raise SequenceTooLongError(
                f"the prompt has {num_prompt_tokens} tokens but max_context_len is {limit}, "
                f"which must also fit at least one generated token; shorten the prompt to at most "
                f"{limit - 1} tokens or raise {FLAG_MAX_CONTEXT_LEN}",
                param="messages",
            )
        if num_seqs > self.config.max_running_seqs:
            raise TooManySamplesError(
                f"n={num_seqs} needs {num_seqs} cache slots but the engine has "
                f"{self.config.max_running_seqs} ({FLAG_MAX_RUNNING}); ask for fewer samples",
                param="n",
            )

    @property
    def max_context_len(self) -> int:
        return self.config.max_context_len

    def find(self, request_id: str) -> SequenceGroup | None:
        """The waiting or running group of `request_id`, if any."""
        group = self._running.get(request_id)
        if group is None:
            group = next((g for g in self._waiting if g.request_id == request_id), None)
        return group

    def request_ids(self) -> list[str]:
        """Ids of every waiting or running request."""
        return [*self._running, *(g.request_id for g in self._waiting)]

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work: decode every running sequence, then admit waiting groups
        (unless `hold_admission` is set, e.g. while the engine drains for a pause)."""
        decode = [
            seq
            for group in self._running.values()
            for seq in group.seqs
            if seq.status is SequenceStatus.RUNNING and self._may_decode(seq)
        ]
        prefill = [] if self.hold_admission else self._admit()
        return SchedulerOutput(prefill, decode, self.num_waiting, self.num_running)

    def _may_decode(self, seq: Sequence) -> bool:
        """False for a sequence whose in-flight token is sure to be its last (by max_tokens or
        the context length): another step would be wasted, or write past its cache slot. A stop
        token it may have drawn is only known once the host reads it, so such a sequence
        decodes one step more and the engine drops that token."""
        return not seq.num_in_flight or not reaches_length_limit(
            seq, self.config.max_context_len, ahead=seq.num_in_flight
        )

    def _admit(self) -> list[SequenceGroup]:
        # NOTE: strict FCFS: the head of the queue blocks later groups, even smaller ones, so that
        # a group with large n (needing many slots at once) or a long prompt cannot starve.
        admitted: list[SequenceGroup] = []
        budget = self.config.max_prefill_tokens_per_step
        while self._waiting:
            group = self._waiting[0]
            if not self.slots.can_allocate(group.num_seqs):
                break
            if admitted and group.num_prompt_tokens > budget:
                break
            self._waiting.pop(0)
            for seq, slot in zip(group.seqs, self.slots.allocate(group.num_seqs), strict=True):
                seq.slot = slot
                seq.status = SequenceStatus.RUNNING
            self._running[group.request_id] = group
            admitted.append(group)
            budget -= group.num_prompt_tokens
        return admitted

    def update(self, finished: Iterable[Sequence]) -> list[int]:
        """Free the slots of sequences the engine finished this step (`Sequence.finish` already
        called); a group leaves the running set when all its sequences are done. Returns the
        slots freed. Sequences already freed (e.g. by `cancel`) are ignored."""
        freed = []
        for seq in finished:
            assert seq.is_finished, f"sequence {seq.seq_id} is not finished ({seq.status})"
            if seq.slot is not None:
                self.slots.free(seq.slot)
                freed.append(seq.slot)
                seq.slot = None
            group = self._running.get(seq.request_id)
            if group is not None and group.is_finished:
                del self._running[seq.request_id]
        return freed

    def cancel(self, request_id: str) -> list[int]:
        """Abort a waiting or running request: its unfinished sequences finish with "abort" and
        every slot it held is freed (returned, so the engine can reset them). Unknown or already
        finished ids return [] because cancellation races with natural completion."""
        group = self._running.pop(request_id, None)
        if group is None:
            index = next(
                (i for i, g in enumerate(self._waiting) if g.request_id == request_id), None
            )
            if index is None:
                return []
            group = self._waiting.pop(index)
        for seq in group.unfinished_seqs():
            seq.finish("abort")
        return self.update(group.seqs)


@dataclass(frozen=True)
class StopCheck:
    """Why a sequence stops after its newest token.

    reason: "stop" or "length".
    stop_str: the stop string matched, if any.
    stop_str_start: where it starts in the `detokenized_tail` given to `check_stop`.
    text_end: where the output text should end in that tail: the stop string's start, or its end
        with `include_stop_str_in_output`. None when no stop string matched.
    """

    reason: str
    stop_str: str | None = None
    stop_str_start: int | None = None
    text_end: int | None = None


def check_stop(
    seq: Sequence,
    new_token_id: int,
    eos_token_ids: Collection[int],
    detokenized_tail: str | None,
    *,
    max_context_len: int,
) -> StopCheck | None:
    """Whether `seq` stops after `new_token_id`, which the caller has already appended.

    Stop reasons win over length ones (OpenAI semantics): EOS (unless `ignore_eos`) and
    `stop_token_ids` first, then stop strings, then `max_tokens`, then `max_context_len`.
    `detokenized_tail` is the end of the output text, including the new token's text and at
    least `max(len(s) for s in stop) - 1` characters before it, so a stop string spanning two
    tokens is found; a match earlier in the tail would have stopped an earlier step. Pass None
    when the request has no stop strings (detokenization stays with the caller).
    """
    assert seq.last_token_id == new_token_id and seq.output_token_ids, "append the token first"
    params = seq.params
    if new_token_id in params.stop_token_ids or (
        not params.ignore_eos and new_token_id in eos_token_ids
    ):
        return StopCheck("stop")
    if params.stop and detokenized_tail:
        found = _find_stop_string(params.stop, detokenized_tail)
        if found is not None:
            start, stop_str = found
            end = start + len(stop_str) if params.include_stop_str_in_output else start
            return StopCheck("stop", stop_str, start, end)
    if reaches_length_limit(seq, max_context_len):
        return StopCheck("length")
    return None


def reaches_length_limit(seq: Sequence, max_context_len: int, ahead: int = 0) -> bool:
    """Whether `seq`, with `ahead` more tokens than it has read, is at max_tokens or fills the
    context: its last token then is its final one."""
    max_tokens = seq.params.max_tokens
    if max_tokens is not None and seq.num_output_tokens + ahead >= max_tokens:
        return True
    return seq.num_tokens + ahead >= max_context_len


def _find_stop_string(stops: tuple[str, ...], text: str) -> tuple[int, str] | None:
    """The earliest stop string in `text` (the longest one on a tie), as (start, string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        if best is None or start < best[0] or (start == best[0] and len(stop) > len(best[1])):
            best = (start, stop)
    return best
