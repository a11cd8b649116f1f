"""The scheduler: which sequences run this step. Pure Python over request state; no tensors.

Two resources bound what runs. Slots (`max_running_prompts`, `--max-running-prompts`) cap how many
sequences run at once; each holds a row of linear-attention state. KV blocks of `block_size`
tokens (areno/engine/kv/block_manager.py) hold every running sequence's keys and values, taken as it
grows and returned when it ends, so memory is spent on the tokens sequences have, not on
`max_context_len` per slot. A sequence that reaches `max_context_len` finishes with "length"
(see `check_stop`).

Sequences, not requests, are the unit: a request of n samples runs as many of them at once as
slots allow, the rest wait (never refused for lack of slots). Waiting sequences are admitted
strictly first come, first served, oldest request first. When a running sequence needs a block
and none is free, the newest running sequence is preempted: its slot and blocks are freed and it
waits again, at the front (it is older than anything admitted after it), to be prefilled again
from its prompt and the tokens it had (recomputation). It resumes with the same tokens.

A prompt longer than what is left of the step's prefill budget (`max_num_batched_tokens`,
`--max-num-batched-tokens`) is prefilled in chunks over several steps when its group allows it,
beside the running decodes, so that a long prompt does not stall every stream. A chunk ends
anywhere, media included (the engine encodes a prompt's media once, at its first chunk, and
each chunk consumes its part of the features), except inside a run the group holds whole (its
`whole_runs`: tokens the model attends to both ways); a first chunk over the budget, or a
prompt that may not be chunked, is admitted alone.

Step contract (one `schedule()` per engine step):
- `prefill`: sequences admitted this step, in `ScheduledPrefill`s: the new samples of one request
  admitted together share one prefill of the prompt (its full blocks shared, the last partial
  block copied for each); a late or resumed sample has its own prefill of all its tokens. An
  item covers tokens `start`..`end` of its sequences; only a final one (`end` the whole) samples.
- `decode`: every sequence that was running before this step. The runner feeds each one's
  `last_token_id` and samples one token; its blocks already cover that token's position.
After executing, the engine appends each token, calls `check_stop`, marks finished sequences with
`Sequence.finish`, and hands them to `update` to free their slots and blocks.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from areno.engine.kv.block_manager import blocks_for
from areno.engine.kv.manager import KVCacheManager
from areno.engine.outputs.stopping import reaches_length_limit
from areno.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from areno.errors import ArenoError, ConfigError, PromptTooLongError

FLAG_MAX_CONTEXT_LEN = "--max-context-len"


class SequenceTooLongError(PromptTooLongError):
    """The prompt leaves no room for a single generated token within max_context_len."""


class DuplicateRequestError(ArenoError):
    """A request id is already waiting or running."""

    code = "duplicate_request_id"


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits.

    max_running_prompts: cache slots, i.e. sequences running at once.
    max_context_len: tokens one sequence may reach (prompt plus output).
    max_num_batched_tokens: prompt tokens prefilled per step, so a long prompt or a burst
        of them does not stall running decodes for long: a longer prompt is prefilled in chunks
        (module docstring); one that may not be split that far runs alone so it never starves.
    num_blocks: KV blocks in the pool (None: every slot's `max_context_len`, as a slot cache
        would hold). It must hold one sequence of max_context_len tokens.
    block_size: tokens per KV block.
    enable_prefix_caching: register each computed full block under its prefix hash
        (`block_hashes`) and admit a prompt from its longest cached prefix: its blocks are
        shared, its prefill starts after them. Freed blocks stay cached until evicted.
    num_state_rows: rows of saved slot state (the runner's) for a model whose layers keep
        state besides keys (linear attention, sliding windows): its prompts resume only where
        a state was saved (areno/engine/kv/state_cache.py). 0: every layer keeps keys only.
    saves_text_prompts: a text prompt's prefill saves those states at its last full block
        too, as a prompt with media's does (`PrefixCache.plan_prompt_saves`).
    checkpoint_blocks: a prompt's prefill saves those states every this many blocks as well
        (and where it parts from a cached prompt); 0: not.
    """

    max_running_prompts: int
    max_context_len: int
    max_num_batched_tokens: int = 8192
    num_blocks: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = False
    num_state_rows: int = 0
    saves_text_prompts: bool = False
    checkpoint_blocks: int = 0

    def __post_init__(self) -> None:
        limits = {
            "max_running_prompts": 1,
            # One prompt token plus one generated token is the least that makes sense.
            "max_context_len": 2,
            "max_num_batched_tokens": 1,
            "block_size": 1,
        }
        for name, least in limits.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(
                    f"SchedulerConfig.{name} must be an integer >= {least}; got {value!r}",
                    param=name,
                )
        if self.num_blocks is None:
            blocks = self.max_running_prompts * blocks_for(self.max_context_len, self.block_size)
            object.__setattr__(self, "num_blocks", blocks)
        least = blocks_for(self.max_context_len, self.block_size)
        if self.num_blocks < least:
            raise ConfigError(
                f"the KV cache pool has {self.num_blocks} blocks of {self.block_size} tokens, "
                f"fewer than the {least} one sequence of {self.max_context_len} tokens "
                f"({FLAG_MAX_CONTEXT_LEN}) needs; give it more memory (--kv-cache-gib or "
                f"--kv-cache-memory-fraction) or lower {FLAG_MAX_CONTEXT_LEN}",
                param="kv_cache_gib",
            )


@dataclass
class ScheduledPrefill:
    """Sequences of one group that share one prefill this step: the group's prompt for new
    samples admitted together, or one resumed / late sequence's own tokens; tokens
    `start`..`end` of them (a chunk, or all)."""

    group: SequenceGroup
    seqs: list[Sequence]
    start: int
    end: int
    cached: int = 0  # tokens the prefix cache gave: the first chunk starts here
    # Before it runs, the saved state row to restore into its slot, and a (source, destination)
    # block to copy: the resume point's tail (state_cache.py).
    restore_row: int | None = None
    copy_block: tuple[int, int] | None = None
    # (position, row) pairs, by position: save the slot's state in `row` once the prefill
    # reaches `position`.
    saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.seqs[0].token_ids

    @property
    def num_tokens(self) -> int:
        """The tokens the sequences' prefill covers in all (its last chunk's end)."""
        return self.seqs[0].prefill_end

    @property
    def num_chunk_tokens(self) -> int:
        return self.end - self.start

    @property
    def is_final(self) -> bool:
        """Whether this prefill reaches the sequences' last token (and so samples)."""
        return self.end == self.num_tokens


@dataclass
class SchedulerOutput:
    """What to run this step; see the module docstring for the prefill / decode contract.

    num_waiting / num_running count sequences after this step's admission; `preempted` lists
    the sequences preempted this step.
    """

    prefill: list[ScheduledPrefill]
    decode: list[Sequence]
    num_waiting: int
    num_running: int
    preempted: list[Sequence] = field(default_factory=list)
    # (slot, row): save the states of slots whose sequences ended into saved-state rows,
    # before anything else runs (state_cache.py).
    state_saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_prefill_tokens(self) -> int:
        return sum(item.num_chunk_tokens for item in self.prefill)


def _queue_key(seq: Sequence) -> tuple[int, int]:
    return seq.arrival, seq.sample_index


class Scheduler:
    """FCFS admission of waiting sequences into free slots and blocks; running sequences decode
    each step, preempting the newest when blocks run out."""

    # Blocks kept free at admission, as a share of the pool, so that admitting does not make
    # the next step preempt at once (vLLM's watermark).
    WATERMARK = 0.01

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._waiting: list[Sequence] = []  # sorted by (arrival, sample index)
        self._running: list[Sequence] = []  # in admission order: the newest last
        self._groups: dict[str, SequenceGroup] = {}  # unfinished requests, in arrival order
        self.hold_admission = False
        self.num_preemptions = 0
        # Prompt tokens admitted, and of them those the prefix cache held.
        self.num_admitted_tokens = 0
        self.num_cached_tokens = 0
        self.kv = KVCacheManager(
            num_slots=config.max_running_prompts,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            num_state_rows=config.num_state_rows,
            groups=self._groups,
            saves_text_prompts=config.saves_text_prompts,
            checkpoint_blocks=config.checkpoint_blocks,
        )
        self._watermark = int(self.WATERMARK * config.num_blocks)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a slot and blocks."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Sequences holding a slot."""
        return self.kv.num_used_slots

    @property
    def num_free_slots(self) -> int:
        return self.kv.num_free_slots

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running (the engine loop may sleep when not)."""
        return bool(self._groups)

    def add(self, group: SequenceGroup) -> None:
        """Queue a new request; it runs once slots and blocks free up (requests are never
        dropped).

        Raises SequenceTooLongError or DuplicateRequestError for a request that could never
        run, so it fails at once instead of waiting forever.
        """
        self.check_fits(group.num_prompt_tokens)
        if group.request_id in self._groups:
            raise DuplicateRequestError(f"request id {group.request_id!r} is already in use")
        self._groups[group.request_id] = group
        for seq in group.seqs:
            bisect.insort(self._waiting, seq, key=_queue_key)

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Raise for a request that could never run (see `add`). Any number of samples fits:
        they run as slots allow."""
        limit = self.config.max_context_len
        if num_prompt_tokens >= limit:
            raise SequenceTooLongError(
                f"the prompt has {num_prompt_tokens} tokens but max_context_len is {limit}, "
                f"which must also fit at least one generated token; shorten the prompt to at most "
                f"{limit - 1} tokens or raise {FLAG_MAX_CONTEXT_LEN}",
                param="messages",
            )

    @property
    def max_context_len(self) -> int:
        return self.config.max_context_len

    def find(self, request_id: str) -> SequenceGroup | None:
        """The waiting or running group of `request_id`, if any."""
        return self._groups.get(request_id)

    def request_ids(self) -> list[str]:
        """Ids of every waiting or running request."""
        return list(self._groups)

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work: decode every running sequence (preempting the newest where
        blocks run out), then admit waiting sequences (unless `hold_admission` is set, e.g.
        while the engine drains for a pause, or this step preempted)."""
        self.kv.new_step()
        self.kv.register(self._running)
        decode, preempted = self._reserve_decode_blocks()
        self.kv.save_last_states(self._running, self._may_decode)
        budget = self.config.max_num_batched_tokens
        prefill = self._continue_chunks(budget)
        budget -= sum(item.num_chunk_tokens for item in prefill)
        if not (self.hold_admission or preempted):
            prefill += self._admit(budget, first=not prefill)
        out = SchedulerOutput(prefill, decode, self.num_waiting, self.num_running, preempted)
        if not out.is_empty:  # else they wait for the next step that runs (before any reuse)
            out.state_saves = self.kv.take_saves()
        return out

    def _is_prefilling(self, seq: Sequence) -> bool:
        return seq.num_computed_tokens < seq.prefill_end

    def forget_cached(self) -> None:
        """Forget every cached block and saved state (new weights make them stale)."""
        self.kv.forget(self._running)

    def recompute_running(self) -> None:
        """Send every running sequence back to wait, at the front, to be prefilled again from
        its prompt and the tokens it has (as a preemption does, not counted as one): after new
        weights, its later tokens are then sampled from keys and values the new weights
        computed. The engine reads the step in flight first."""
        for seq in reversed(self._running[:]):  # newest first: each is inserted at its place
            self._requeue(seq)

    def _continue_chunks(self, budget: int) -> list[ScheduledPrefill]:
        """The next chunk of every sequence whose prompt is being prefilled in chunks, oldest
        first, within `budget` tokens (the oldest always gets one: it never starves)."""
        items = []
        for seq in self._running:
            if not self._is_prefilling(seq):
                continue
            if budget <= 0 and items:
                break
            group = self._groups[seq.request_id]
            start = seq.num_computed_tokens
            limit = min(seq.prefill_end, start + max(budget, self.config.block_size))
            end = _chunk_end(group, start, limit)
            seq.num_computed_tokens = seq.num_fed_tokens = end
            item = ScheduledPrefill(group, [seq], start, end)
            item.saves = self.kv.take_saves_of(seq, start, end)
            items.append(item)
            budget -= end - start
        return items

    def would_preempt(self) -> bool:
        """Whether this step's decodes need more blocks than are free (an overlapped engine
        reads the step in flight first: only a sequence with no unread token is preempted)."""
        return self._blocks_needed(self._decoding()) > self.kv.num_free_blocks

    def _decoding(self) -> list[Sequence]:
        return [
            seq
            for seq in self._running
            if seq.status is SequenceStatus.RUNNING and not self._is_prefilling(seq)
            if self._may_decode(seq)
        ]

    def _blocks_needed(self, seqs: list[Sequence]) -> int:
        return sum(max(self.kv.blocks_to_grow(seq), 0) for seq in seqs)

    def _reserve_decode_blocks(self) -> tuple[list[Sequence], list[Sequence]]:
        """Give every decoding sequence, oldest first, the blocks its next token needs,
        preempting the newest running sequences while blocks are short."""
        decode, preempted = [], []
        for seq in self._decoding():
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted by an older sequence of this step
            need = self.kv.blocks_to_grow(seq)
            while need > 0 and not self.kv.can_grow(need):
                victim = self._running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if need > 0:
                self.kv.grow(seq, need)
            seq.num_fed_tokens = seq.next_position + 1
            decode.append(seq)
        return decode, preempted

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        """Free a running sequence's slot and blocks; it waits to be prefilled again."""
        assert not seq.num_in_flight, "read a sequence's token in flight before preempting it"
        self._release(seq)
        seq.num_computed_tokens = seq.prefill_end = seq.num_fed_tokens = 0
        self._running.remove(seq)
        seq.status = SequenceStatus.WAITING
        bisect.insort(self._waiting, seq, key=_queue_key)

    def _may_decode(self, seq: Sequence) -> bool:
        """False for a sequence whose in-flight token is sure to be its last (by max_tokens or
        the context length): another step would be wasted, or write past its context. A stop
        token it may have drawn is only known once the host reads it, so such a sequence
        decodes one step more and the engine drops that token."""
        return not seq.num_in_flight or not reaches_length_limit(
            seq, self.config.max_context_len, ahead=seq.num_in_flight
        )

    def _admit(self, budget: int, *, first: bool) -> list[ScheduledPrefill]:
        """Admit waiting sequences, oldest first, into free slots and blocks, within `budget`
        prompt tokens. `first`: nothing else prefills this step, so a prompt over the budget
        that may not be chunked runs alone rather than never."""
        # NOTE: FCFS: the head of the queue blocks later sequences, even smaller ones, so that a
        # long prompt cannot starve; only a sequence waiting for its group's prefill is passed.
        admitted: list[ScheduledPrefill] = []
        block_size = self.config.block_size
        index = 0  # the first waiting sequence not passed over this step
        while index < len(self._waiting) and self.kv.can_allocate_slot():
            seq = self._waiting[index]
            group = self._groups[seq.request_id]
            last = admitted[-1] if admitted else None
            joins = _joins(last, seq, group)
            end = seq.num_tokens
            prefix = None
            if joins:
                shared = seq.num_prompt_tokens // block_size
                need = len(last.seqs[0].block_ids) - shared
            elif self.kv.awaits(seq, group, self._running):
                # It waits a step or so for what a running sequence is computing (its group's
                # prompt); the sequences behind it go past meanwhile.
                index += 1
                continue
            else:
                prefix = self.kv.lookup(seq, group)
                cached = prefix.num_tokens
                need = blocks_for(seq.num_tokens, block_size) - len(prefix.blocks)
                if seq.num_tokens - cached > budget:
                    if group.can_chunk and budget >= block_size:
                        end = _chunk_end(group, cached, cached + budget)  # the rest later
                    if end - cached > budget and (admitted or not first):
                        break
            if not self.kv.can_admit(need, prefix, self._watermark if self._running else 0):
                break
            self._waiting.pop(index)
            seq.status = SequenceStatus.RUNNING
            if group.scheduled_at is None:
                group.scheduled_at = time.perf_counter()
            seq.prefill_end, seq.num_computed_tokens = seq.num_tokens, end
            seq.num_fed_tokens = end
            if joins:
                self.kv.join(seq, last.seqs[0], shared, need)
                last.seqs.append(seq)
            else:
                admission = self.kv.admit(seq, group, prefix, need)
                item = ScheduledPrefill(group, [seq], cached, end, cached)
                item.restore_row, item.copy_block = admission.restore_row, admission.copy_block
                item.saves = self.kv.take_saves_of(seq, item.start, item.end)
                admitted.append(item)
                budget -= end - cached
                self.num_admitted_tokens += seq.num_tokens
                self.num_cached_tokens += cached
                group.num_prefill_tokens += seq.num_tokens
                group.num_cached_tokens += cached
            self._running.append(seq)
        return admitted

    def _release(self, seq: Sequence) -> None:
        self.kv.release(seq)

    def update(self, finished: Iterable[Sequence]) -> None:
        """Free the slots and blocks of sequences the engine finished this step
        (`Sequence.finish` already called); a group leaves when all its sequences are done.
        Sequences already freed (e.g. by `cancel`) are ignored."""
        finished = list(finished)
        for seq in finished:
            assert seq.is_finished, f"sequence {seq.seq_id} is not finished ({seq.status})"
            if seq in self._running:
                self._running.remove(seq)
            elif seq in self._waiting:
                self._waiting.remove(seq)
            self._release(seq)
        for seq in finished:  # after all: releasing a sequence reads its group
            group = self._groups.get(seq.request_id)
            if group is not None and group.is_finished:
                del self._groups[seq.request_id]

    def cancel(self, request_id: str) -> None:
        """Abort a waiting or running request: its unfinished sequences finish with "abort" and
        every slot and block it held is freed. Unknown or already finished ids are ignored
        because cancellation races with natural completion."""
        group = self._groups.get(request_id)
        if group is None:
            return
        for seq in group.unfinished_seqs():
            seq.finish("abort")
        self.update(group.seqs)


def _joins(last: ScheduledPrefill | None, seq: Sequence, group: SequenceGroup) -> bool:
    """Whether `seq`, a new sample of the group whose new samples were admitted just before
    (`last`), shares their prefill: only its own copy of the last, partial block is new."""
    return (
        last is not None
        and last.group is group
        and last.is_final
        and last.start == 0
        and not seq.output_token_ids
        and not last.seqs[0].output_token_ids
    )


def _chunk_end(group: SequenceGroup, start: int, end: int) -> int:
    """Where a chunk of a prefill from `start` ends: at `end`, or where that falls inside a run
    the group holds whole (`whole_runs`), before the run if the chunk has tokens before it,
    else after it (a run longer than the budget is one chunk)."""
    for run_start, run_end in group.whole_runs:
        if run_start < end < run_end:
            return run_start if run_start > start else run_end
    return end
