"""What an episode leaves behind: the exact token sequence the generator saw and produced."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areno.processing.types import PromptInputs


@dataclass
class ToolCallRecord:
    """One tool call of an episode: what the model asked for and what the tool answered."""

    turn: int
    name: str
    arguments: str  # the JSON text the model produced
    result_text: str  # the text parts of the result ("" for media only)
    num_media: int = 0  # media items the result carried back to the model


@dataclass
class RecordedCall:
    """One chat call of a program's episode, as the engine ran it.

    `prompt_ids` are the encoded prompt's ids (a forced call opening included); `token_ids`,
    `logprobs` (the sampled distribution's, as `run_episode` records them) and `token_versions`
    are the sampled tokens'. `messages` and `tools` are what the program sent, for the reward and
    the leak guard; `content` and `tool_calls` what its reply said."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    policy_version: int
    finish_reason: str
    messages: list[dict]
    tools: list[dict] | None = None
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments"} each
    num_malformed_tool_calls: int = 0
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class Trajectory:
    """One episode, token-in / token-out.

    `inputs` holds every token of the episode (prompt, generated turns, tool results) with the
    media tensors of every media item in it, so the trainer's forward sees exactly what the
    generator saw. `loss_mask[i]` is 1 for tokens the model sampled, 0 for prompt and tool tokens;
    `rollout_logprobs[i]` is the generator's logprob of token i (0 where the mask is 0).
    """

    sample_id: str | None
    episode_index: int
    inputs: PromptInputs
    num_prompt_tokens: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    policy_versions: list[int]  # one per generated turn: the version it ended on
    final_text: str = ""  # the last assistant turn's content (tool-call markup removed)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)  # every assistant turn's raw text
    # answer | final_tool | max_turns | length | context | aborted (the engine cut a turn off:
    # `Generator.pause(mode="abort")` or its shutdown; that turn is no answer); an agent
    # program's (each part of its episode): answer | error | timeout
    finish: str = "answer"
    num_malformed_tool_calls: int = 0
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    # the policy version of each sampled token (loss_mask 1), in order: with partial rollouts
    # (rollout.partial_rollouts) weights may change in the middle of a turn, and each token's
    # rollout logprob is the policy's its version names
    token_versions: list[int] = field(default_factory=list)
    # prompt tokens the engine prefilled over the episode's turns and, of them, those its
    # prefix cache held (the step's prefill metrics sum them)
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0
    # An agent program's episode (areno.rollout.calls): its final output and every call it made
    # (all of them, in each part), and which of the episode's `num_parts` trajectories this is.
    # The reward is computed once per episode and every part carries it.
    program_output: Any = None
    calls: list[RecordedCall] = field(default_factory=list)
    part: int = 0
    num_parts: int = 1

    @property
    def token_ids(self) -> list[int]:
        return self.inputs.input_ids

    @property
    def num_tokens(self) -> int:
        return len(self.inputs.input_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def num_turns(self) -> int:
        return len(self.policy_versions)

    @property
    def policy_version(self) -> int:
        """The oldest policy that produced any of its tokens (what staleness is measured by)."""
        versions = self.token_versions or self.policy_versions
        return min(versions) if versions else 0

    @property
    def media_hashes(self) -> list[str]:
        return [span.content_hash for span in self.inputs.mm_spans]

    def check(self) -> None:
        """NOTE: the per-token lists line up with the token ids (an invariant, not user input)."""
        n = self.num_tokens
        assert len(self.loss_mask) == n and len(self.rollout_logprobs) == n, (
            len(self.loss_mask),
            len(self.rollout_logprobs),
            n,
        )
