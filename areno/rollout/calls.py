"""An agent program's episode as training data: the calls it made, recorded on the server side,
turned into trajectories.

A program (`rollout.program`) talks to the policy through OpenAI chat calls; the training route
records each call as the engine ran it (`RecordedCall`: the encoded prompt's ids, the sampled
ids, their logprobs and policy versions). The program's own text is never tokenized again:
`trajectories_from_calls` builds trajectories from those ids alone. Consecutive calls where each
prompt extends the previous call's prompt and reply (the common chat loop) make one multi-turn
trajectory, exactly like a `run_episode` trajectory; a call whose prompt does not (a framework
that rewrites the history, a sub-agent) starts another one, a separate transition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from areno.processing.types import PromptInputs
from areno.rollout.trajectory import RecordedCall, ToolCallRecord, Trajectory


@dataclass
class ProgramEpisode:
    """What a program's episode left: its calls (and each call's encoded prompt, with media, kept
    on the worker to build the trajectories), its final output, and why it ended."""

    episode_index: int
    calls: list[RecordedCall] = field(default_factory=list)
    prompts: list[PromptInputs] = field(default_factory=list)
    output: Any = None
    # answer | error (the program raised) | timeout (rollout.program_timeout_s)
    finish: str = "answer"
    error: str | None = None


def extends(
    call: RecordedCall, prompt: PromptInputs, before: RecordedCall, prior: PromptInputs
) -> bool:
    """Whether `call`'s prompt starts with `before`'s prompt and reply: the same ids, and the same
    media in the same places (equal placeholder ids may stand for different images)."""
    seen = before.prompt_ids + before.token_ids
    if call.prompt_ids[: len(seen)] != seen:
        return False
    spans = [(s.start, s.end, s.content_hash) for s in prompt.mm_spans]
    return spans[: len(prior.mm_spans)] == [
        (s.start, s.end, s.content_hash) for s in prior.mm_spans
    ]


def chains(episode: ProgramEpisode) -> list[list[int]]:
    """The episode's calls (by index) in runs where each extends the one before it."""
    runs: list[list[int]] = []
    for index, call in enumerate(episode.calls):
        if runs:
            last = runs[-1][-1]
            before, prior = episode.calls[last], episode.prompts[last]
            if extends(call, episode.prompts[index], before, prior):
                runs[-1].append(index)
                continue
        runs.append([index])
    return runs


def trajectories_from_calls(sample_id: str | None, episode: ProgramEpisode) -> list[Trajectory]:
    """One trajectory per run of extending calls (`chains`); each carries the whole episode (its
    output and every call) for the reward, and which part of the episode it is."""
    runs = chains(episode)
    trajectories = [_trajectory(sample_id, episode, run) for run in runs]
    for part, traj in enumerate(trajectories):
        traj.part, traj.num_parts = part, len(trajectories)
    return trajectories


def _trajectory(sample_id: str | None, episode: ProgramEpisode, run: Sequence[int]) -> Trajectory:
    """The trajectory of calls `run`: the last call's prompt and reply, every call's sampled
    tokens masked in (loss mask 1, their logprobs), every other token (prompt, the program's
    messages between calls, a forced call opening) masked out."""
    first = episode.calls[run[0]]
    n = len(first.prompt_ids)
    traj = Trajectory(sample_id, episode.episode_index, episode.prompts[run[0]], n, [], [], [])
    covered = 0
    for index in run:
        call = episode.calls[index]
        added = len(call.prompt_ids) - covered
        traj.loss_mask += [0] * added + [1] * len(call.token_ids)
        traj.rollout_logprobs += [0.0] * added + list(call.logprobs)
        traj.token_versions += call.token_versions
        traj.policy_versions.append(call.policy_version)
        traj.turn_texts.append(call.content)
        traj.num_malformed_tool_calls += call.num_malformed_tool_calls
        traj.num_prefill_tokens += call.num_prefill_tokens
        traj.num_cached_tokens += call.num_cached_tokens
        traj.tool_calls += [
            ToolCallRecord(len(traj.policy_versions) - 1, c["name"], c["arguments"], "")
            for c in call.tool_calls
        ]
        covered = len(call.prompt_ids) + len(call.token_ids)
    last = episode.calls[run[-1]]
    traj.inputs = episode.prompts[run[-1]].with_tokens(last.prompt_ids + last.token_ids)
    traj.final_text = output_text(episode.output)
    traj.program_output = episode.output
    traj.calls = list(episode.calls)
    traj.finish = episode.finish
    traj.check()
    return traj


def output_text(output: Any) -> str:
    """A program's final output as the text a reward reads (`Trajectory.final_text`)."""
    if output is None:
        return ""
    if isinstance(output, str):
        return output
    final = getattr(output, "final_output", None)  # an Agents SDK RunResult
    return str(final) if final is not None else str(output)
