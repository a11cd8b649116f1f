"""Scheduler: FCFS admission into slots and KV blocks, prefill budget, n > 1 (shared prompt
blocks, samples beyond the slots), blocks taken as sequences grow, preemption and resumption,
cancellation, stop checks."""

from __future__ import annotations

import pytest

from areno.engine.core.scheduler import (
    DuplicateRequestError,
    Scheduler,
    SchedulerConfig,
    SequenceTooLongError,
)
from areno.engine.kv.block_manager import BlockManager
from areno.engine.kv.manager import SlotAllocator
from areno.engine.outputs.stopping import check_stop
from areno.engine.sampling import SamplingParams
from areno.engine.sequence import SequenceGroup, SequenceStatus
from areno.errors import ArenoError, ConfigError, PromptTooLongError

EOS = frozenset({2})


def group(request_id: str, num_prompt_tokens: int = 4, **params) -> SequenceGroup:
    return SequenceGroup.create(
        request_id, list(range(10, 10 + num_prompt_tokens)), SamplingParams(**params)
    )


def scheduler(
    max_running_prompts: int = 4,
    max_context_len: int = 64,
    budget: int = 1000,
    num_blocks: int | None = None,
    block_size: int = 16,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_running_prompts, max_context_len, budget, num_blocks, block_size)
    )


def ids(prefill) -> list[str]:
    return [item.group.request_id for item in prefill]


def finish_all(sched: Scheduler, g: SequenceGroup, reason: str = "stop") -> None:
    for seq in g.seqs:
        seq.finish(reason)
    sched.update(g.seqs)


def decode_step(sched: Scheduler, token: int = 5):
    """One step whose decodes and final prefills get a token (as the engine appends them)."""
    out = sched.schedule()
    for seq in [s for item in out.prefill if item.is_final for s in item.seqs] + out.decode:
        seq.append_token(token)
    return out


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_running_prompts must be an integer >= 1; got 0"):
        SchedulerConfig(0, 64)
    with pytest.raises(ConfigError, match="max_context_len must be an integer >= 2"):
        SchedulerConfig(4, 1)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        SchedulerConfig(4, 64, 0)
    assert SchedulerConfig(4, 64).num_blocks == 16  # every slot's 64 tokens, as slots were
    with pytest.raises(ConfigError, match="3 blocks of 16 tokens, fewer than the 4 one sequence"):
        SchedulerConfig(4, 64, num_blocks=3)


def test_slot_allocator_hands_out_lowest_free_slots() -> None:
    slots = SlotAllocator(4)
    assert slots.allocate(3) == [0, 1, 2]
    slots.free(1)
    assert slots.can_allocate(2) and not slots.can_allocate(3)
    assert slots.allocate(2) == [1, 3]
    assert slots.num_free == 0 and slots.num_used == 4
    with pytest.raises(RuntimeError, match="only 0 free"):
        slots.allocate(1)
    slots.free(2)
    with pytest.raises(RuntimeError, match="double free"):
        slots.free(2)


def test_block_manager_counts_references() -> None:
    blocks = BlockManager(4, 16)
    a = blocks.allocate(2)
    assert a == [1, 2] and blocks.num_free == 2  # block 0 is the sink: never handed out
    shared = blocks.share(a[:1])
    blocks.free(a)
    assert blocks.num_free == 3 and blocks.num_refs(1) == 1  # still held by the fork
    blocks.free(shared)
    assert blocks.num_free == 4
    with pytest.raises(RuntimeError, match="double free"):
        blocks.free([1])


def test_fcfs_admission_respects_max_running_and_queues() -> None:
    sched = scheduler(max_running_prompts=2)
    groups = [group(f"r{i}") for i in range(4)]
    for g in groups:
        sched.add(g)
    out = decode_step(sched)
    assert ids(out.prefill) == ["r0", "r1"] and out.decode == []
    assert (out.num_running, out.num_waiting) == (2, 2)
    assert [item.seqs[0].slot for item in out.prefill] == [0, 1]
    assert all(item.seqs[0].status is SequenceStatus.RUNNING for item in out.prefill)

    # Full: the next step only decodes; nothing is dropped.
    out = decode_step(sched)
    assert out.prefill == [] and [s.request_id for s in out.decode] == ["r0", "r1"]
    assert sched.num_free_slots == 0 and sched.num_waiting == 2

    # Freeing r0 admits r2 (the oldest waiting) into r0's slot; r2 does not decode this step.
    finish_all(sched, groups[0])
    out = decode_step(sched)
    assert ids(out.prefill) == ["r2"] and groups[2].seqs[0].slot == 0
    assert [s.request_id for s in out.decode] == ["r1"]
    out = sched.schedule()
    assert [s.request_id for s in out.decode] == ["r1", "r2"]


def test_admission_follows_arrival_not_add_order() -> None:
    sched = scheduler(max_running_prompts=1)
    early, late = group("early"), group("late")
    sched.add(late)
    sched.add(early)
    assert ids(sched.schedule().prefill) == ["early"]


def test_prefill_token_budget_limits_admission_per_step() -> None:
    sched = scheduler(max_running_prompts=8, budget=10)
    for name, length in [("a", 4), ("b", 5), ("c", 4)]:
        sched.add(group(name, length))
    assert ids(sched.schedule().prefill) == ["a", "b"]  # 9 tokens; c would make 13
    assert ids(sched.schedule().prefill) == ["c"]


def test_prompt_over_budget_is_admitted_alone() -> None:
    sched = scheduler(max_running_prompts=8, budget=10)
    sched.add(group("long", 30))
    sched.add(group("short", 2))
    out = sched.schedule()
    assert ids(out.prefill) == ["long"] and out.num_prefill_tokens == 30
    assert ids(sched.schedule().prefill) == ["short"]


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_decodes() -> None:
    sched = scheduler(max_running_prompts=4, budget=10, num_blocks=32, block_size=4)
    sched.add(short := group("short", 3))
    decode_step(sched)
    long = group("long", 25)
    long.can_chunk = True
    sched.add(long)
    seq = long.seqs[0]
    spans = []
    for _ in range(3):
        out = decode_step(sched)
        assert out.decode == [short.seqs[0]]  # the stream keeps decoding every step
        spans += [(p.start, p.end, p.is_final) for p in out.prefill]
    assert spans == [(0, 10, False), (10, 20, False), (20, 25, True)]
    assert len(seq.block_ids) == 7 and seq.output_token_ids == [5]  # only the last samples
    assert sched.schedule().decode == [short.seqs[0], seq]


def test_chunks_end_before_or_after_a_run_held_whole() -> None:
    sched = scheduler(max_running_prompts=4, budget=10, num_blocks=32, block_size=4)
    sched.add(short := group("short", 3))
    decode_step(sched)
    image = group("image", 40)
    # Tokens 8..13 and 16..31 see each other both ways: no chunk may end inside either.
    image.can_chunk, image.whole_runs = True, [(8, 13), (16, 32)]
    sched.add(image)
    spans = []
    while not spans or not spans[-1][2]:
        out = decode_step(sched)
        assert out.decode == [short.seqs[0]]
        spans += [(p.start, p.end, p.is_final) for p in out.prefill]
    # Before the first run (it would cut it); after the second (longer than the budget).
    assert spans == [(0, 8, False), (8, 16, False), (16, 32, False), (32, 40, True)]


def test_a_prompt_that_may_not_be_chunked_runs_alone_over_the_budget() -> None:
    sched = scheduler(max_running_prompts=4, budget=10)
    sched.add(group("whole", 25))  # can_chunk False
    sched.add(group("next", 3))
    out = sched.schedule()
    assert ids(out.prefill) == ["whole"] and out.prefill[0].is_final
    assert ids(sched.schedule().prefill) == ["next"]


def test_samples_beyond_the_free_slots_wait_for_them() -> None:
    sched = scheduler(max_running_prompts=4)
    sched.add(one := group("one", n=2))
    sched.add(pair := group("pair", n=3))
    sched.add(group("small"))
    out = decode_step(sched)
    # Two of pair's samples take the last two slots (one prefill); its third and "small" wait.
    assert ids(out.prefill) == ["one", "pair"]
    assert [s.slot for s in out.prefill[0].seqs] == [0, 1]
    assert [s.sample_index for s in out.prefill[1].seqs] == [0, 1]
    assert [s.slot for s in out.prefill[1].seqs] == [2, 3]
    assert out.num_waiting == 2 and sched.num_free_slots == 0

    finish_all(sched, one)
    out = decode_step(sched)
    # pair's third sample prefills its prompt alone; "small" follows it in arrival order.
    assert ids(out.prefill) == ["pair", "small"] and out.prefill[0].seqs == [pair.seqs[2]]
    assert out.num_waiting == 0 and out.num_running == 4


def test_n_samples_share_the_prompts_full_blocks_and_own_its_last_one() -> None:
    sched = scheduler(max_running_prompts=4, num_blocks=16, block_size=4)
    g = group("fork", num_prompt_tokens=10, n=3, seed=7)
    sched.add(g)
    out = sched.schedule()
    assert len(out.prefill) == 1 and out.prefill[0].seqs == g.seqs
    assert sorted(s.slot for s in g.seqs) == [0, 1, 2]
    assert [s.seed for s in g.seqs] == [7, 8, 9]
    tables = [s.block_ids for s in g.seqs]
    # 10 tokens: two full blocks shared by all, a partial third block for each.
    assert all(t[:2] == tables[0][:2] for t in tables) and len({t[2] for t in tables}) == 3
    assert sched.kv.blocks.num_used == 5 and sched.kv.blocks.num_refs(tables[0][0]) == 3
    for seq in g.seqs:
        seq.append_token(5)
    assert [s.slot for s in sched.schedule().decode] == [0, 1, 2]
    finish_all(sched, g)
    assert sched.kv.blocks.num_free == 16


def test_a_sequence_takes_a_block_when_it_crosses_into_one() -> None:
    sched = scheduler(num_blocks=16, block_size=4)
    sched.add(g := group("a", num_prompt_tokens=3))
    seq = g.seqs[0]
    decode_step(sched)  # prefill: 3 tokens in one block; a token sampled (position 3)
    assert len(seq.block_ids) == 1
    decode_step(sched)  # feeds position 3: still the first block
    assert len(seq.block_ids) == 1
    decode_step(sched)  # feeds position 4: a second block
    assert len(seq.block_ids) == 2 and sched.kv.blocks.num_used == 2


def test_the_newest_sequence_is_preempted_and_resumes_with_its_tokens() -> None:
    # 4 blocks of 4 tokens; two prompts of 7 tokens take 2 blocks each, and the first to need a
    # third block takes it from the newest sequence.
    sched = scheduler(max_running_prompts=2, max_context_len=16, num_blocks=4, block_size=4)
    sched.add(old := group("old", num_prompt_tokens=7))
    sched.add(new := group("new", num_prompt_tokens=7))
    a, b = old.seqs[0], new.seqs[0]
    decode_step(sched, token=5)  # both prefilled, each with a token at position 7
    out = decode_step(sched, token=6)  # positions 7: the second block holds them
    assert out.decode == [a, b] and sched.kv.blocks.num_free == 0
    out = decode_step(sched, token=7)  # position 8 needs a third block: "new" gives way
    assert out.preempted == [b] and out.decode == [a] and out.prefill == []
    assert b.status is SequenceStatus.WAITING and b.slot is None and b.block_ids == []
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert len(a.block_ids) == 3 and sched.num_waiting == 1
    finish_all(sched, old)
    out = sched.schedule()
    # resumed: prefills its prompt and the two tokens it had, then samples its third
    assert ids(out.prefill) == ["new"] and out.prefill[0].token_ids == new.prompt_token_ids + [5, 6]
    assert out.prefill[0].num_tokens == 9 and len(b.block_ids) == 3


def test_a_sequence_alone_that_outgrows_the_pool_preempts_itself_only_when_it_must() -> None:
    sched = scheduler(max_running_prompts=2, max_context_len=8, num_blocks=2, block_size=4)
    sched.add(g := group("a", num_prompt_tokens=5))
    for _ in range(3):
        out = decode_step(sched)
        assert out.preempted == []
    assert len(g.seqs[0].block_ids) == 2  # 8 tokens: the whole pool, the whole context


def test_an_overlapped_engine_reads_its_tokens_before_a_preemption() -> None:
    sched = scheduler(max_running_prompts=2, max_context_len=16, num_blocks=5, block_size=4)
    sched.add(old := group("old", num_prompt_tokens=8))
    sched.add(new := group("new", num_prompt_tokens=7))
    decode_step(sched)
    assert not sched.would_preempt()  # "old" crosses into a third block: the last free one
    sched.schedule()
    old.seqs[0].append_token(5)  # read
    new.seqs[0].num_in_flight = 1  # not read yet: it feeds position 8 next, a third block
    assert sched.would_preempt()
    new.seqs[0].num_in_flight = 0
    new.seqs[0].append_token(5)
    assert sched.schedule().preempted == [new.seqs[0]]


def test_cancel_waiting_request() -> None:
    sched = scheduler(max_running_prompts=1)
    running, waiting = group("run"), group("wait", n=1)
    sched.add(running)
    sched.add(waiting)
    sched.schedule()
    sched.cancel("wait")
    assert waiting.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert waiting.seqs[0].finish_reason == "abort"
    assert sched.num_waiting == 0 and sched.find("wait") is None
    sched.cancel("wait")  # a second cancel is a no-op


def test_cancel_running_request_frees_its_slots_and_blocks() -> None:
    sched = scheduler(max_running_prompts=3)
    g = group("big", n=3)
    sched.add(g)
    sched.add(group("next"))
    sched.schedule()
    g.seqs[1].finish("stop")  # one sample already done and freed; cancel skips it
    sched.update([g.seqs[1]])
    assert sched.num_free_slots == 1
    sched.cancel("big")
    assert [s.finish_reason for s in g.seqs] == ["abort", "stop", "abort"]
    assert all(s.slot is None and s.block_ids == [] for s in g.seqs)
    assert sched.num_free_slots == 3 and sched.kv.blocks.num_used == 0
    assert ids(sched.schedule().prefill) == ["next"]
    sched.cancel("unknown")


def test_finished_group_leaves_and_has_work_ends() -> None:
    sched = scheduler()
    g = group("a", n=2)
    sched.add(g)
    assert sched.has_work
    decode_step(sched)
    g.seqs[0].finish("stop")
    sched.update([g.seqs[0]])
    assert sched.has_work and len(sched.schedule().decode) == 1
    g.seqs[1].finish("length")
    sched.update([g.seqs[1]])
    assert not sched.has_work and sched.schedule().is_empty


def test_a_token_in_flight_that_must_be_the_last_is_not_decoded_again() -> None:
    sched = scheduler(max_context_len=8)
    sched.add(g := group("a", num_prompt_tokens=4, max_tokens=2))
    sched.add(h := group("b", num_prompt_tokens=6, max_tokens=10))
    assert ids(sched.schedule().prefill) == ["a", "b"]
    a, b = g.seqs[0], h.seqs[0]
    for seq in (a, b):  # the prefill's token is in flight: both may decode
        seq.num_in_flight = 1
    assert sched.schedule().decode == [a, b]
    assert (a.next_position, b.next_position) == (4, 6)
    # Their first tokens are read and their next ones in flight: a's is its max_tokens-th, and
    # b's fills the context (6 + 1 + 1 = 8 tokens). Neither may decode after it.
    a.append_token(5)
    b.append_token(5)
    assert sched.schedule().decode == []
    a.num_in_flight = b.num_in_flight = 0  # nothing in flight: the engine decides on reading
    assert sched.schedule().decode == [a, b]


def test_too_long_prompt_is_rejected_with_lengths() -> None:
    sched = scheduler(max_context_len=16)
    with pytest.raises(SequenceTooLongError) as info:
        sched.add(group("long", 16))
    message = str(info.value)
    assert "16 tokens" in message and "max_context_len is 16" in message
    assert "at most 15" in message and "--max-context-len" in message
    assert isinstance(info.value, PromptTooLongError) and isinstance(info.value, ArenoError)
    sched.add(group("fits", 15))  # one token of room is enough


def test_duplicate_requests_are_rejected_and_many_samples_are_not() -> None:
    sched = scheduler(max_running_prompts=2)
    sched.add(group("many", n=8))
    sched.add(group("dup"))
    with pytest.raises(DuplicateRequestError, match="'dup'"):
        sched.add(group("dup"))


# check_stop: the caller appends the token, then asks.


def decoded(num_prompt_tokens: int = 4, **params):
    seq = group("s", num_prompt_tokens, **params).seqs[0]
    seq.status = SequenceStatus.RUNNING
    return seq


def step(seq, token_id: int, tail: str | None = None, max_context_len: int = 64):
    seq.append_token(token_id)
    return check_stop(seq, token_id, EOS, tail, max_context_len=max_context_len)


def test_check_stop_on_eos_and_stop_token_ids() -> None:
    assert step(decoded(), 2).reason == "stop"
    assert step(decoded(stop_token_ids=(7,)), 7).reason == "stop"
    assert step(decoded(), 7) is None


def test_check_stop_ignore_eos_keeps_going_but_honours_stop_token_ids() -> None:
    assert step(decoded(ignore_eos=True), 2) is None
    assert step(decoded(ignore_eos=True, stop_token_ids=(2,)), 2).reason == "stop"


def test_check_stop_on_max_tokens() -> None:
    seq = decoded(max_tokens=3)
    assert step(seq, 5) is None and step(seq, 6) is None
    assert step(seq, 7).reason == "length"


def test_check_stop_on_max_context_len() -> None:
    seq = decoded(num_prompt_tokens=6)
    assert step(seq, 5, max_context_len=8) is None
    assert step(seq, 5, max_context_len=8).reason == "length"  # 8 tokens: the slot is full


def test_stop_beats_length() -> None:
    assert step(decoded(max_tokens=1), 2).reason == "stop"


def test_stop_string_spanning_two_tokens() -> None:
    seq = decoded(stop=("END",))
    assert step(seq, 5, "Hello E") is None
    result = step(seq, 6, "llo END!")  # "E" came with the last token, "ND!" with this one
    assert result.reason == "stop" and result.stop_str == "END"
    assert result.stop_str_start == 4 and result.text_end == 4
    assert "llo END!"[: result.text_end] == "llo "


def test_stop_string_kept_when_requested_and_earliest_wins() -> None:
    seq = decoded(stop=("world", "lo"), include_stop_str_in_output=True)
    result = step(seq, 5, "hello world")
    assert (result.stop_str, result.stop_str_start, result.text_end) == ("lo", 3, 5)


def test_no_stop_string_check_without_text() -> None:
    assert step(decoded(stop=("x",)), 5, None) is None


def test_a_sequence_running_across_new_weights_never_caches_its_blocks():
    """Keys computed partly with old weights stay their sequence's own: after `forget_cached`
    (new weights) a running sequence registers no more blocks, and one admitted after does."""
    sched = Scheduler(SchedulerConfig(4, 128, 1000, None, 4, enable_prefix_caching=True))
    old = group("old", num_prompt_tokens=9)
    old.can_chunk = True
    sched.add(old)
    (item,) = sched.schedule().prefill
    sched.forget_cached()
    new = group("new", num_prompt_tokens=9)  # the same prompt: it need not wait for "old"
    new.can_chunk = True
    sched.add(new)
    assert [i.group for i in sched.schedule().prefill] == [new]
    (old_seq,), (new_seq,) = old.seqs, new.seqs
    assert old_seq.num_registered_blocks == 0
    sched.schedule()
    assert new_seq.num_registered_blocks == 2
    assert sched.kv.blocks.num_cached == 2


def test_a_sample_waiting_for_its_groups_prefill_lets_later_requests_pass() -> None:
    """With prefix caching, a GRPO group's later samples (requests of their own) wait a step for
    the first one's prompt blocks; a different request behind them is admitted meanwhile."""
    sched = Scheduler(SchedulerConfig(4, 128, 1000, None, 16, enable_prefix_caching=True))
    prompt = list(range(10, 50))  # two full blocks and 8 tokens
    first, second = (
        SequenceGroup.create(rid, prompt, SamplingParams(), can_chunk=True)
        for rid in ("g-0", "g-1")
    )
    other = SequenceGroup.create("other", list(range(60, 70)), SamplingParams(), can_chunk=True)
    for g in (first, second, other):
        sched.add(g)
    assert ids(decode_step(sched).prefill) == ["g-0", "other"]
    out = decode_step(sched)  # g-0's blocks are cached now: g-1 starts from them
    assert ids(out.prefill) == ["g-1"] and out.prefill[0].start == 32
