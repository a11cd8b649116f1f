"""Multi-turn (agentic) episodes as training data, on the tiny Gemma 4 of the AVE example.

The real generator samples every turn; tools return an image written with Pillow and an audio
clip, which run_episode encodes and appends between turns; the parser is scripted
(tests/rollout/scripted.py). Checked against what the generator actually produced:
- the loss mask is 1 exactly on each turn's sampled tokens, 0 on the prompt, on the tool results
  (media placeholders included) and on the end-of-turn token the episode appends itself;
- the rollout logprobs sit on those same tokens, and the policy's one forward over the whole
  episode (fp32, before any update) gives them back, with each tool result's media acting on the
  turns after it and on none before;
- an episode that ends on a truncated turn, a malformed call, bad call arguments, the context
  limit, the turn limit or a turn the engine cut off ends as `Trajectory.finish` documents.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time

import pytest
import torch

from areno.engine.sampling import SamplingParams
from areno.rollout import ToolContext
from areno.rollout.episode import (
    EpisodeLimits,
    RolloutEnv,
    encode_prompt,
    encode_prompt_for,
    run_episode,
)
from areno.train.policy import load_policy, sequence_logprobs
from tests.rollout.scripted import ScriptedTurns, Turn, _schema, make_setup, run_scripted

LOOK, HEAR, SUBMIT = Turn(("look",)), Turn(("hear",)), Turn(("submit",))


class TimedTurns(ScriptedTurns):
    """ScriptedTurns that also record when each generate call started."""

    def __init__(self, generator, script):
        super().__init__(generator, script)
        self.started: list[float] = []

    async def generate_all(self, inputs, params):
        self.started.append(time.monotonic())
        return await super().generate_all(inputs, params)


@pytest.fixture(scope="module")
def setup(tiny_path, tmp_path_factory):
    setup = make_setup(tiny_path("gemma4"), tmp_path_factory.mktemp("scene"))
    yield setup
    setup.shutdown()


@pytest.fixture(scope="module")
def episode(setup):
    """look (an image back) -> hear (an audio clip back) -> submit (final)."""
    return run_scripted(setup, [LOOK, HEAR, SUBMIT], seed=3)[0]


@pytest.fixture(scope="module")
def policy(setup):
    model, _, _ = load_policy(setup.checkpoint, dtype=torch.float32)
    return model.eval()


def expected_mask(traj, sampled) -> list[int]:
    mask = [0] * traj.num_tokens
    for turn in sampled:
        mask[turn.start : turn.start + len(turn.token_ids)] = [1] * len(turn.token_ids)
    return mask


def turn_slices(traj, sampled) -> list[slice]:
    """Each turn's sampled tokens, as positions of the scored part (tokens from the prompt on)."""
    n = traj.num_prompt_tokens
    return [slice(t.start - n, t.start - n + len(t.token_ids)) for t in sampled]


def test_loss_mask_is_one_exactly_on_the_sampled_tokens_of_every_turn(setup, episode):
    traj, sampled = episode
    assert traj.finish == "final_tool" and traj.num_turns == len(sampled) == 3
    assert [c.name for c in traj.tool_calls] == ["look", "hear", "submit"]
    assert [c.num_media for c in traj.tool_calls] == [1, 1, 0]
    assert sampled[0].start == traj.num_prompt_tokens
    for turn, following in zip(sampled, [*sampled[1:], None], strict=True):
        end = turn.start + len(turn.token_ids)
        # the tokens and their logprobs are the generator's, at the positions it sampled them
        assert traj.token_ids[turn.start : end] == turn.token_ids
        assert traj.rollout_logprobs[turn.start : end] == turn.logprobs
        # the turn was cut, not ended by the model: the episode closes it with end-of-turn
        assert turn.token_ids[-1] != setup.eot and traj.token_ids[end] == setup.eot
        # then the tool result, through the next generation prompt: all 0
        if following is not None:
            assert following.start > end + 1
    assert traj.loss_mask == expected_mask(traj, sampled)
    assert traj.num_generated_tokens == sum(len(t.token_ids) for t in sampled)
    off = [lp for lp, bit in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if not bit]
    assert set(off) == {0.0}
    # every media item (prompt and tool results) sits on mask-0 tokens
    assert [s.modality for s in traj.inputs.mm_spans] == ["image", "audio", "image", "audio"]
    for span in traj.inputs.mm_spans:
        assert not any(traj.loss_mask[span.start : span.end])
    assert traj.policy_versions == [0, 0, 0]


def test_policy_scores_every_turn_as_the_generator_did(episode, policy):
    """One forward over the whole episode, with the prompt's and the tools' media, gives the
    rollout logprobs of every turn's tokens (fp32, before any update)."""
    traj, sampled = episode
    start = traj.num_prompt_tokens
    with torch.no_grad():
        scored = sequence_logprobs(policy, traj.inputs, "cpu", start)
    rollout = torch.tensor(traj.rollout_logprobs[start:])
    mask = torch.tensor(traj.loss_mask[start:], dtype=torch.bool)
    assert scored.shape == rollout.shape
    diff = (scored - rollout)[mask].abs()
    assert diff.numel() == traj.num_generated_tokens
    assert diff.max().item() < 1e-4, diff.max().item()
    for part in turn_slices(traj, sampled):
        assert (scored[part] - rollout[part]).abs().max().item() < 1e-4


@pytest.mark.parametrize("key, item", [("pixel_values", 1), ("input_features", 1)])
def test_tool_media_act_on_the_later_turns_only(episode, policy, key, item):
    """Replacing the features of the tool's image (look, after turn 1) or audio clip (hear,
    after turn 2) changes the logprobs of the turns after it and of none before: the media of a
    tool result sit where the generator put them."""
    traj, sampled = episode
    start = traj.num_prompt_tokens
    values = traj.inputs.mm_inputs[key].clone()
    generator = torch.Generator().manual_seed(0)
    values[item] = torch.randn(values[item].shape, generator=generator) * values.std() + 1.0
    inputs = dataclasses.replace(traj.inputs, mm_inputs={**traj.inputs.mm_inputs, key: values})
    with torch.no_grad():
        base = sequence_logprobs(policy, traj.inputs, "cpu", start)
        changed = sequence_logprobs(policy, inputs, "cpu", start)
    modality = "image" if key == "pixel_values" else "audio"
    span = [s for s in traj.inputs.mm_spans if s.modality == modality][item]
    slices = turn_slices(traj, sampled)
    before = [p for p, t in zip(slices, sampled, strict=True) if t.start < span.start]
    after = [p for p, t in zip(slices, sampled, strict=True) if t.start > span.end]
    assert before and after
    for part in before:
        torch.testing.assert_close(changed[part], base[part], atol=1e-6, rtol=0)
    assert max((changed[p] - base[p]).abs().max().item() for p in after) > 1e-3


def test_a_call_cut_off_by_the_token_limit_is_not_run(setup):
    """finish="length": the truncated turn is kept and trained on as sampled (mask 1), its call
    is not run, nothing is appended after it (no end-of-turn, no tool result)."""
    traj, sampled = run_scripted(setup, [Turn(("look",), stopped=False)], seed=5)[0]
    (turn,) = sampled
    assert turn.finish_reason == "length" and turn.token_ids[-1] != setup.eot
    assert traj.finish == "length" and traj.tool_calls == [] and traj.num_turns == 1
    n = traj.num_prompt_tokens
    assert traj.token_ids[n:] == turn.token_ids
    assert traj.loss_mask == [0] * n + [1] * len(turn.token_ids)
    assert len(traj.inputs.mm_spans) == 2  # the prompt's image and audio only


def test_a_malformed_call_is_a_final_answer(setup):
    """A block the parser cannot read as a call is content: the turn is the final answer
    (finish="answer"), counted as malformed, its tokens trained on as sampled."""
    traj, sampled = run_scripted(setup, [Turn((), malformed=1)], seed=7)[0]
    (turn,) = sampled
    assert traj.finish == "answer" and traj.num_malformed_tool_calls == 1
    assert traj.tool_calls == [] and traj.num_turns == 1
    n = traj.num_prompt_tokens
    assert traj.token_ids[n:] == turn.token_ids
    assert traj.loss_mask == [0] * n + [1] * len(turn.token_ids)


def test_arguments_that_are_not_an_object_come_back_as_an_error(setup):
    """The call runs as an error text for the model to read, and the episode goes on."""
    traj, sampled = run_scripted(setup, [Turn(("look",), arguments="[1, 2]"), SUBMIT], seed=9)[0]
    assert traj.finish == "final_tool" and traj.num_turns == 2
    first = traj.tool_calls[0]
    assert first.name == "look" and first.num_media == 0
    assert first.result_text == "error: the arguments must be a JSON object"
    assert traj.loss_mask == expected_mask(traj, sampled)


def test_the_context_limit_keeps_the_sampled_turn_and_drops_the_result(setup):
    """A tool result that does not fit ends the episode (finish="context") without it: the
    sampled turn stays (mask 1), closed by an end-of-turn token (mask 0)."""
    prompt = run_scripted(setup, [Turn(())], seed=1)[0][0].num_prompt_tokens
    traj, sampled = run_scripted(setup, [LOOK, SUBMIT], seed=11, max_context_len=prompt + 20)[0]
    (turn,) = sampled
    assert traj.finish == "context" and traj.num_turns == 1
    n = traj.num_prompt_tokens
    assert traj.token_ids[n:] == [*turn.token_ids, setup.eot]
    assert traj.loss_mask == [0] * n + [1] * len(turn.token_ids) + [0]
    assert len(traj.inputs.mm_spans) == 2


def test_the_turn_limit_ends_after_the_last_turn(setup):
    traj, sampled = run_scripted(setup, [LOOK, LOOK, LOOK], seed=13)[0]
    assert traj.finish == "max_turns" and traj.num_turns == 3
    assert traj.loss_mask == expected_mask(traj, sampled)


def sampled_any(scheduler) -> bool:
    """Whether a request in the engine has sampled a token (read from the test's thread: a
    snapshot)."""
    groups = [scheduler.find(request_id) for request_id in scheduler.request_ids()]
    return any(seq.num_output_tokens for group in groups if group for seq in group.seqs)


def test_a_turn_the_engine_cuts_off_ends_the_episode_as_aborted(setup):
    """pause("abort") mid-turn: the episode ends with finish="aborted" (not an answer), the
    turn's tokens kept as sampled and its call not run; after resume episodes run again."""
    env_base = RolloutEnv(setup.decoder, setup.processor, setup.generator, None)
    prompt = encode_prompt_for(env_base, setup.agent, setup.messages)
    scripted = ScriptedTurns(setup.generator, [LOOK])
    env = RolloutEnv(setup.decoder, setup.processor, scripted, scripted)
    sampling = SamplingParams(temperature=1.0, seed=17, ignore_eos=True)
    limits = EpisodeLimits(4096, max_tokens_per_turn=3000)

    async def main():
        ctx = ToolContext("scene", setup.messages, 0)
        episode = asyncio.create_task(run_episode(env, setup.agent, ctx, prompt, sampling, limits))
        while not sampled_any(setup.generator.core.scheduler):
            await asyncio.sleep(0.005)
        await setup.generator.pause("abort")
        traj = await episode
        await setup.generator.resume()
        return traj

    traj = asyncio.run(main())
    (turn,) = scripted.sampled
    assert turn.finish_reason == "abort" and 0 < len(turn.token_ids) < 3000
    assert traj.finish == "aborted" and traj.tool_calls == [] and traj.num_turns == 1
    n = traj.num_prompt_tokens
    assert traj.token_ids[n:] == turn.token_ids
    assert traj.loss_mask == [0] * n + [1] * len(turn.token_ids)
    assert run_scripted(setup, [SUBMIT], seed=3)[0][0].finish == "final_tool"


def test_log_completions_shows_each_turn_with_its_calls_and_results(setup, monkeypatch, caplog):
    """ARENO_LOG_COMPLETIONS=1: one JSON line per turn, with the parsed calls as executed."""
    import json
    import logging

    from areno.rollout.episode import COMPLETION_LOGGER

    monkeypatch.setenv("ARENO_LOG_COMPLETIONS", "1")
    with caplog.at_level(logging.INFO, logger=COMPLETION_LOGGER):
        traj, sampled = run_scripted(setup, [LOOK, HEAR, SUBMIT], seed=3)[0]
    lines = [
        json.loads(r.getMessage().removeprefix("completion "))
        for r in caplog.records
        if r.name == COMPLETION_LOGGER
    ]
    assert [line["turn"] for line in lines] == [0, 1, 2]
    assert [line["completion_tokens"] for line in lines] == [len(t.token_ids) for t in sampled]
    calls = [line["tool_calls"] for line in lines]
    assert [[c["name"] for c in turn] for turn in calls] == [["look"], ["hear"], ["submit"]]
    assert [c["result"] for c in calls[0]] == ["a closer look"] and calls[0][0]["result_media"] == 1
    assert calls[1][0]["result_media"] == 1 and calls[2][0]["result"] == "answer recorded"
    assert traj.finish == "final_tool"
    monkeypatch.setenv("ARENO_LOG_COMPLETIONS", "0")
    caplog.clear()
    run_scripted(setup, [SUBMIT], seed=3)
    assert not [r for r in caplog.records if r.name == COMPLETION_LOGGER]


def test_a_slow_tool_leaves_the_other_episodes_turns_flowing(setup):
    """Episode 0's first tool sleeps 2 s; episode 1, on the same worker's event loop, keeps
    running turns meanwhile (its generate calls, timed, fall inside the sleep)."""
    env_base = RolloutEnv(setup.decoder, setup.processor, setup.generator, None)
    prompt = encode_prompt_for(env_base, setup.agent, setup.messages)
    sleeping: list[float] = []

    def slow(arguments, ctx):
        sleeping.append(time.monotonic())
        time.sleep(2.0)
        sleeping.append(time.monotonic())
        return "done, slowly"

    agent = dataclasses.replace(
        setup.agent,
        tools={**setup.agent.tools, "slow": slow},
        tool_schemas=[*setup.agent.tool_schemas, _schema("slow")],
        max_turns=6,
    )
    scripts = [[Turn(("slow",)), SUBMIT], [LOOK, LOOK, LOOK, LOOK, LOOK, SUBMIT]]
    turns = [TimedTurns(setup.generator, script) for script in scripts]
    limits = EpisodeLimits(4096, 4)

    async def both():
        return await asyncio.gather(
            *(
                run_episode(
                    RolloutEnv(setup.decoder, setup.processor, scripted, scripted),
                    agent,
                    ToolContext("scene", setup.messages, index),
                    prompt,
                    SamplingParams(temperature=1.0, seed=index),
                    limits,
                )
                for index, scripted in enumerate(turns)
            )
        )

    asyncio.run(both())
    start, end = sleeping
    during = [t for t in turns[1].started if start < t < end]
    assert len(during) >= 2, (turns[1].started, sleeping)


class ThreadsSeen:
    """A processor that records the thread of each of its encoding calls."""

    CALLS = ("encode", "encode_continuation", "extend")

    def __init__(self, processor):
        self.processor, self.seen = processor, []

    def __getattr__(self, name):
        value = getattr(self.processor, name)
        if name not in self.CALLS:
            return value

        def call(*args, **kwargs):
            self.seen.append((name, threading.current_thread().name))
            return value(*args, **kwargs)

        return call


def test_every_processor_call_of_concurrent_episodes_runs_on_the_one_processor_thread(setup):
    """Three episodes at once, each with three tool turns, on one worker's processor thread (the
    envs share it as a worker's episodes do): the first prompt's encode and every tool result's
    encode and append run there, none on the event loop or a pool thread (a fast tokenizer must
    not be entered by two threads at once), and the episodes still end as scripted."""
    seen = ThreadsSeen(setup.processor)
    thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="areno-processor")
    turns = [ScriptedTurns(setup.generator, [LOOK, HEAR, SUBMIT]) for _ in range(3)]
    envs = [RolloutEnv(setup.decoder, seen, t, t, processor_thread=thread) for t in turns]

    async def episodes():
        prompt = await encode_prompt(envs[0], setup.agent, setup.messages)
        return await asyncio.gather(
            *(
                run_episode(
                    env,
                    setup.agent,
                    ToolContext("scene", setup.messages, index),
                    prompt,
                    SamplingParams(temperature=1.0, seed=index),
                    EpisodeLimits(4096, 6),
                )
                for index, env in enumerate(envs)
            )
        )

    try:
        trajectories = asyncio.run(episodes())
    finally:
        thread.shutdown()
    assert [t.finish for t in trajectories] == ["final_tool"] * 3
    names = [name for name, _ in seen.seen]
    assert names.count("encode") == 1
    assert names.count("encode_continuation") == names.count("extend") == 3 * 3
    assert {where for _, where in seen.seen} == {"areno-processor_0"}
