"""An agent program's recorded calls as trajectories (areno.rollout.calls): runs of calls whose
prompt extends the previous call's prompt and reply make one multi-turn trajectory, masked in
exactly on the sampled tokens; a call that rewrites the history, or puts other media where the
earlier prompt had its own, starts another part, and every part carries the whole episode."""

from __future__ import annotations

import torch

from areno.processing.types import MediaSpan, PromptInputs
from areno.rollout.calls import ProgramEpisode, trajectories_from_calls
from areno.rollout.trajectory import RecordedCall
from areno.train.controller import advantages


def _call(prompt: list[int], sampled: list[int], version: int = 0) -> RecordedCall:
    logprobs = [-0.5 - 0.1 * i for i in range(len(sampled))]
    messages = [{"role": "user", "content": "q"}]
    return RecordedCall(prompt, sampled, logprobs, [version] * len(sampled), version, "stop",
                        messages)  # fmt: skip


def _episode(*calls: tuple[list[int], list[int]], spans=None) -> ProgramEpisode:
    episode = ProgramEpisode(3, output="B")
    for i, (prompt, sampled) in enumerate(calls):
        episode.calls.append(_call(prompt, sampled))
        own = spans[i] if spans else []
        episode.prompts.append(PromptInputs(list(prompt), {}, own))
    return episode


def test_a_chat_loop_is_one_multi_turn_trajectory() -> None:
    # call 2's prompt = call 1's prompt + reply + the program's next message
    episode = _episode(([1, 2, 3], [7, 8]), ([1, 2, 3, 7, 8, 4, 5], [9]))
    (traj,) = trajectories_from_calls("s", episode)
    assert traj.token_ids == [1, 2, 3, 7, 8, 4, 5, 9]
    assert traj.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert traj.rollout_logprobs == [0, 0, 0, -0.5, -0.6, 0, 0, -0.5]
    assert traj.num_prompt_tokens == 3 and traj.num_turns == 2
    assert (traj.part, traj.num_parts, traj.final_text, len(traj.calls)) == (0, 1, "B", 2)


def test_a_rewritten_history_starts_a_separate_transition() -> None:
    episode = _episode(
        ([1, 2, 3], [7, 8]), ([1, 2, 3, 7, 6, 4], [9]), ([1, 2, 3, 7, 6, 4, 9, 5], [4])
    )
    first, second = trajectories_from_calls("s", episode)
    assert (first.token_ids, first.loss_mask) == ([1, 2, 3, 7, 8], [0, 0, 0, 1, 1])
    assert second.token_ids == [1, 2, 3, 7, 6, 4, 9, 5, 4]
    assert second.loss_mask == [0, 0, 0, 0, 0, 0, 1, 0, 1]
    assert [(t.part, t.num_parts) for t in (first, second)] == [(0, 2), (1, 2)]
    assert all(len(t.calls) == 3 and t.episode_index == 3 for t in (first, second))


def test_other_media_in_the_same_place_is_no_extension() -> None:
    image = [MediaSpan("image", 0, 1, 2, 1, "red")]
    other = [MediaSpan("image", 0, 1, 2, 1, "blue")]
    calls = (([1, 5, 2], [7]), ([1, 5, 2, 7, 4], [9]))
    assert len(trajectories_from_calls("s", _episode(*calls, spans=[image, image]))) == 1
    assert len(trajectories_from_calls("s", _episode(*calls, spans=[image, other]))) == 2


def test_the_parts_of_an_episode_count_once_and_share_its_advantage() -> None:
    split = trajectories_from_calls("s", _episode(([1], [2]), ([3], [4]), ([5], [6])))
    whole = trajectories_from_calls("s", _episode(([1], [2])))
    whole[0].episode_index = 4
    for traj in split:
        traj.reward = 1.0
    whole[0].reward = 0.0
    adv = advantages([split + whole], normalize_std=False)
    # one episode at 1 and one at 0: +-0.5, not the 3:1 mean a count by trajectory gives
    assert torch.allclose(adv, torch.tensor([0.5, 0.5, 0.5, -0.5]))
