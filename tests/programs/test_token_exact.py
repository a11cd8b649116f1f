"""Token-exact training data from an agent program with an image, tool calls and several calls.

A ProgramWorker (the rollout worker `areno train` runs for `rollout.program`, here in the test's
process) runs tests/programs/quiz_program.py, written with the official `openai` client, on color
quiz samples (an image each): a forced tool call, its result, a follow-up, then a rewritten
history. The program keeps what the API reported for each call (`prompt_token_ids`, and each
choice's `token_ids`: the engine's ids). Every trajectory the worker hands the trainer, each
part of a split episode included, is checked against those ids alone: its tokens are its last
call's prompt and reply, every earlier call of its run sits at its place, its loss mask is 1
on exactly the sampled ids, and its model inputs carry the image. Nothing is re-tokenized.

A call extends the one before only where the template writes the earlier reply back as the
engine's ids: here the tool-result reply and the follow-up make one multi-turn trajectory, while
the forced tool call stays a transition of its own (the tiny Gemma 4's template writes a call's
arguments back as JSON, the model wrote them in Gemma's own notation), as does the rewrite.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from areno.engine.config import EngineConfig
from areno.engine.sampling import SamplingParams
from areno.programs.worker import ProgramWorker
from areno.rollout.worker import RolloutSpec
from areno.tasks.color_quiz import load

GROUP = 4


@pytest.fixture(scope="module")
def worker_run(tiny_path, tmp_path_factory):
    """Two samples' groups on a ProgramWorker; (trajectories, the program's log lines)."""
    media = tmp_path_factory.mktemp("token-exact")
    samples = list(load(num_samples=2, media_dir=media))
    engine = EngineConfig(
        max_running_prompts=8, max_context_len=1024, decode_graphs="off", decode_compile="off"
    )
    spec = RolloutSpec(
        str(tiny_path("gemma4")), engine, program="tests.programs.quiz_program:run",
        program_max_calls=4, max_tokens_per_turn=48,
    )  # fmt: skip
    worker = ProgramWorker(spec)

    async def main():
        try:
            results = []
            for index, sample in enumerate(samples):
                public = sample.public()
                sampling = SamplingParams(temperature=1.0, seed=11 + index)
                results.append(await worker.run_group(public.id, public.messages, GROUP, sampling))
            return results
        finally:
            await worker.route.stop()

    try:
        results = asyncio.run(main())
    finally:
        worker.shutdown()
    assert all(r.skipped is None for r in results), [r.skipped for r in results]
    program = [json.loads(line) for line in (media / "program-log.jsonl").open()]
    return [t for r in results for t in r.trajectories], program


def _expected(calls: list[dict]) -> tuple[list[int], list[int]]:
    """The ids and loss mask of a run of calls, from the API's ids alone: the last call's
    prompt and reply; 1 on each call's sampled ids, at their place in it."""
    last = calls[-1]
    ids = last["prompt_token_ids"] + last["token_ids"]
    mask = [0] * len(ids)
    for call in calls:
        start = len(call["prompt_token_ids"])
        assert ids[:start] == call["prompt_token_ids"]  # each call extends the run so far
        assert ids[start : start + len(call["token_ids"])] == call["token_ids"]
        mask[start : start + len(call["token_ids"])] = [1] * len(call["token_ids"])
    return ids, mask


def test_every_trained_token_is_the_engines_own_id(worker_run):
    trajectories, program = worker_run
    assert len(program) == 2 * GROUP and all(p["tool_calls"] >= 1 for p in program)
    by_calls = {json.dumps(p["calls"]): p["calls"] for p in program}
    multi_turn = 0
    for traj in trajectories:
        # the episode this trajectory came from, found by the ids the program was given
        reported = by_calls[json.dumps(
            [{"prompt_token_ids": c.prompt_ids, "token_ids": c.token_ids} for c in traj.calls]
        )]  # fmt: skip
        first = next(i for i, c in enumerate(reported) if _starts(traj, c))
        run = [reported[first]]
        for call in reported[first + 1 :]:
            if not _starts(traj, call):
                break
            run.append(call)
        ids, mask = _expected(run)
        assert traj.token_ids == ids and traj.loss_mask == mask
        sampled = [lp for c in traj.calls[first : first + len(run)] for lp in c.logprobs]
        assert [lp for lp, m in zip(traj.rollout_logprobs, mask, strict=True) if m] == sampled
        # the model inputs the trainer runs carry the image, inside the first call's prompt
        assert traj.inputs.num_tokens("image") > 0 and traj.inputs.mm_inputs
        assert all(s.end <= len(run[0]["prompt_token_ids"]) for s in traj.inputs.mm_spans)
        multi_turn += len(run) > 1
    parts = {(t.sample_id, t.episode_index): t.num_parts for t in trajectories}
    assert len(trajectories) == sum(parts.values()) and min(parts.values()) >= 2  # rewritten
    assert multi_turn > 0  # some trajectory is several calls, each in its place


def _starts(traj, call: dict) -> bool:
    """Whether `call` (prompt and reply) lies at the start of the trajectory's ids."""
    seen = call["prompt_token_ids"] + call["token_ids"]
    return traj.token_ids[: len(seen)] == seen
