"""One episode: generate -> parse tool calls -> run tools -> append results -> repeat.

Token-in, token-out: each turn's prompt is the previous turn's exact token sequence, followed by
the tokens the model sampled and the encoded tool results (`Processor.encode_continuation`).
History is never re-templated, so the trainer scores exactly the tokens the generator saw.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from areno.engine.generator import Generator
from areno.engine.sampling import SamplingParams
from areno.logs import completions_logged, stderr_logger
from areno.media.decoder import MediaDecoder
from areno.processing.processor import Processor
from areno.processing.types import PromptInputs
from areno.rollout.agent import Agent, ToolContext
from areno.rollout.trajectory import ToolCallRecord, Trajectory
from areno.tools.base import ToolParser
from areno.tools.reasoning import THINK_END, opens_reasoning, split_reasoning

COMPLETION_LOGGER = "areno.rollout.completions"
RESULT_LOG_CHARS = 200  # of a tool's text result, in a completion log line

# Enough prompt tokens to see whether the generation prompt ends inside `<think>\n`.
_PROMPT_TAIL_TOKENS = 4


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode limits; `max_context_len` bounds the whole episode's token sequence."""

    max_context_len: int
    max_tokens_per_turn: int = 256


T = TypeVar("T")


def _processor_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="areno-processor")


@dataclass
class RolloutEnv:
    """The serving parts an episode runs on, all in one process (a rollout worker).

    Every processor call of the worker's episodes (and of an agent program's route) runs on one
    thread of its own (`processing`), as the Ingress's encodes run on its encode thread: a fast
    tokenizer is never entered by two threads, and the episodes' encodes take turns for the
    interpreter with the engine's thread rather than a pool thread each. Media decoding and
    tools run on the default pool."""

    decoder: MediaDecoder
    processor: Processor
    generator: Generator
    parser: ToolParser
    processor_thread: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=_processor_thread, repr=False
    )

    async def processing(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the processor thread."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.processor_thread, call)

    @property
    def end_of_turn_id(self) -> int:
        tokenizer = self.processor.tokenizer
        return int(tokenizer.convert_tokens_to_ids(self.processor.adapter.stop_tokens[0]))


def encode_prompt_for(
    env: RolloutEnv,
    agent: Agent,
    messages: list[dict],
    tools: list[dict] | None = None,
    sample_id: str | None = None,
    phases: dict[str, float] | None = None,
) -> PromptInputs:
    """The episode's first prompt: the agent's messages with its tools and the sample's own
    `tools` (`Agent.prompt_tools`), decoded and encoded on the one path. `phases`: the seconds
    of its media's decoding ("media_s") and of the processor ("process_s") are added to it."""
    messages, media = _prompt_media(env, agent, messages, phases)
    return _encode_prompt(env, agent, messages, media, tools, sample_id, phases)


async def encode_prompt(
    env: RolloutEnv,
    agent: Agent,
    messages: list[dict],
    tools: list[dict] | None = None,
    sample_id: str | None = None,
    phases: dict[str, float] | None = None,
) -> PromptInputs:
    """`encode_prompt_for` off the event loop: the media decoded on a pool thread, the prompt
    encoded on the processor thread (`RolloutEnv.processing`)."""
    messages, media = await asyncio.to_thread(_prompt_media, env, agent, messages, phases)
    return await env.processing(
        _encode_prompt, env, agent, messages, media, tools, sample_id, phases
    )


def _prompt_media(
    env: RolloutEnv, agent: Agent, messages: list[dict], phases: dict[str, float] | None
) -> tuple[list[dict], list]:
    """The agent's first messages and their decoded media."""
    start = time.perf_counter()
    messages = agent.prompt_messages(messages)
    media = env.decoder.decode_many(env.processor.media_refs(messages))
    if phases is not None:
        _add(phases, "media_s", time.perf_counter() - start)
    return messages, media


def _encode_prompt(
    env: RolloutEnv,
    agent: Agent,
    messages: list[dict],
    media: list,
    tools: list[dict] | None,
    sample_id: str | None,
    phases: dict[str, float] | None,
) -> PromptInputs:
    start = time.perf_counter()
    prompt = env.processor.encode(messages, media, tools=agent.prompt_tools(tools, sample_id))
    if phases is not None:
        _add(phases, "process_s", time.perf_counter() - start)
    return prompt


def _add(phases: dict[str, float], key: str, seconds: float) -> None:
    phases[key] = phases.get(key, 0.0) + seconds


async def run_episode(
    env: RolloutEnv,
    agent: Agent,
    ctx: ToolContext,
    prompt: PromptInputs,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    phases: dict[str, float] | None = None,
) -> Trajectory:
    """Run one episode from an encoded prompt until a final answer, a turn limit or the context
    limit, and return its Trajectory (reward not yet set). `phases`: the seconds its turns
    waited for the generator ("generate_s"), its tools ran ("tools_s") and their results were
    decoded and encoded into the next turn's prompt ("tool_inputs_s") are added to it."""
    phases = {} if phases is None else phases
    inputs = prompt
    n = prompt.num_prompt_tokens
    traj = Trajectory(ctx.sample_id, ctx.episode_index, prompt, n, [0] * n, [0.0] * n, [])
    eot = env.end_of_turn_id
    for turn in range(agent.max_turns):
        room = limits.max_context_len - inputs.num_prompt_tokens
        if room < 1:
            traj.finish = "context"
            break
        params = _turn_params(sampling, limits, room, ctx.episode_index, turn)
        start = time.perf_counter()
        output = await env.generator.generate_all(inputs, params)
        _add(phases, "generate_s", time.perf_counter() - start)
        sample = output.samples[0]
        generated = list(sample.token_ids)
        traj.policy_versions.append(output.policy_version)
        traj.num_prefill_tokens += output.num_prefill_tokens
        traj.num_cached_tokens += output.num_cached_tokens
        traj.token_versions += sample.policy_versions or [output.policy_version] * len(generated)
        traj.loss_mask += [1] * len(generated)
        traj.rollout_logprobs += list(sample.logprobs or [0.0] * len(generated))
        traj.turn_texts.append(sample.text)
        if sample.finish_reason == "abort":
            # Cut off by the engine (pause "abort", shutdown): the tokens stay as sampled, but
            # the turn is no answer and its calls are not run.
            inputs = inputs.with_tokens(inputs.input_ids + generated)
            traj.finish = "aborted"
            _log_turn(ctx, turn, output, None, traj)
            break
        reply = reply_text(env.processor.tokenizer, inputs.input_ids, sample.text)
        parsed = env.parser.parse(reply, agent.tool_schemas or None)
        traj.num_malformed_tool_calls += parsed.num_malformed
        traj.final_text = parsed.content
        if sample.finish_reason == "length" and len(generated) >= room:
            inputs = inputs.with_tokens(inputs.input_ids + generated)
            traj.finish = "context"
            _log_turn(ctx, turn, output, parsed, traj)
            break
        if not parsed.tool_calls or sample.finish_reason == "length":
            inputs = inputs.with_tokens(inputs.input_ids + generated)
            traj.finish = "answer" if sample.finish_reason != "length" else "length"
            _log_turn(ctx, turn, output, parsed, traj)
            break
        if not generated or generated[-1] != eot:
            generated.append(eot)  # close the turn the way the template would; not trained on
            traj.loss_mask.append(0)
            traj.rollout_logprobs.append(0.0)
        # NOTE: off the event loop, in a thread: a slow tool, its media's decoding and the
        # encoding of its results never stall the worker's other episodes.
        start = time.perf_counter()
        results, final = await asyncio.to_thread(
            _run_tools, agent, ctx, parsed.tool_calls, turn, traj
        )
        _add(phases, "tools_s", time.perf_counter() - start)
        _log_turn(ctx, turn, output, parsed, traj)
        start = time.perf_counter()
        media = await asyncio.to_thread(_results_media, env, results)
        delta = await env.processing(
            env.processor.encode_continuation, results, media, tools=agent.tool_schemas or None
        )
        if inputs.num_prompt_tokens + len(generated) + delta.num_prompt_tokens >= (
            limits.max_context_len
        ):
            inputs = inputs.with_tokens(inputs.input_ids + generated)
            traj.finish = "context"
            break
        before = inputs.num_prompt_tokens + len(generated)
        inputs = await env.processing(env.processor.extend, inputs, generated, delta)
        _add(phases, "tool_inputs_s", time.perf_counter() - start)
        # NOTE: not delta.num_prompt_tokens: a family that numbers media per prompt (MiniCPM-V)
        # may renumber the delta's media, which can change its length by a digit.
        added = inputs.num_prompt_tokens - before
        traj.loss_mask += [0] * added
        traj.rollout_logprobs += [0.0] * added
        if final:
            traj.finish = "final_tool"
            break
    else:
        traj.finish = "max_turns"
    traj.inputs = inputs
    traj.check()
    return traj


def reply_text(tokenizer: Any, prompt_ids: list[int], text: str) -> str:
    """A turn's text less the reasoning block its prompt opened (a thinking template's
    `<think>`), as serving splits it: only the reply is parsed for calls and is the final text
    the reward reads. Unlike serving, a block the model never closed is not all reasoning here:
    the whole text is parsed, so a policy that skips straight to its call still acts."""
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:])
    if THINK_END in text and opens_reasoning(tail):
        return split_reasoning(text)[1]
    return text


def _turn_params(
    sampling: SamplingParams, limits: EpisodeLimits, room: int, episode: int, turn: int
) -> SamplingParams:
    max_tokens = min(room, limits.max_tokens_per_turn, sampling.max_tokens or room)
    seed = None if sampling.seed is None else sampling.seed + 7919 * episode + turn
    return dataclasses.replace(
        sampling,
        n=1,
        max_tokens=max_tokens,
        seed=seed,
        logprobs=True,
        top_logprobs=0,
        # The sampled distribution's logprobs: the trainer recomputes them at this temperature.
        logprobs_mode="tempered",
        detokenize=True,
        skip_special_tokens=False,  # tool-call tags may be special tokens
    )


def _log_turn(ctx: ToolContext, turn: int, output: Any, parsed: Any, traj: Trajectory) -> None:
    """With ARENO_LOG_COMPLETIONS=1: the turn's text, its parsed calls and what they returned
    (text, and how many media parts), as one JSON line."""
    if not completions_logged():
        return
    sample = output.samples[0]
    line = {
        "sample_id": ctx.sample_id,
        "episode": ctx.episode_index,
        "turn": turn,
        "policy_version": output.policy_version,
        "completion_tokens": len(sample.token_ids),
        "finish_reason": sample.finish_reason,
        "abort_cause": sample.abort_cause,
        "text": sample.text,
        "malformed_tool_calls": parsed.num_malformed if parsed is not None else 0,
        "tool_calls": [
            {
                "name": r.name,
                "arguments": r.arguments,
                "result": r.result_text[:RESULT_LOG_CHARS],
                "result_media": r.num_media,
            }
            for r in traj.tool_calls
            if r.turn == turn
        ],
    }
    stderr_logger(COMPLETION_LOGGER).info("completion %s", json.dumps(line, ensure_ascii=False))


def _run_tools(
    agent: Agent, ctx: ToolContext, calls: list, turn: int, traj: Trajectory
) -> tuple[list[dict], bool]:
    """Run each parsed call; returns the tool messages and whether a final tool was called."""
    messages, final = [], False
    for call in calls:
        name = call.function.name
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            result: Any = "error: the arguments must be a JSON object"
        else:
            result = agent.call_tool(name, arguments, ctx)
        content = _as_content(result)
        text = " ".join(part["text"] for part in content if part.get("type") == "text")
        num_media = sum(1 for part in content if part.get("type") != "text")
        traj.tool_calls.append(
            ToolCallRecord(turn, name, call.function.arguments or "", text, num_media)
        )
        messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
        final = final or name in agent.final_tools
    return messages, final


def _as_content(result: Any) -> list[dict]:
    if isinstance(result, str):
        return [{"type": "text", "text": result}]
    if isinstance(result, list) and all(isinstance(p, dict) and "type" in p for p in result):
        return result
    return [{"type": "text", "text": str(result)}]


def _results_media(env: RolloutEnv, messages: list[dict]) -> list:
    """The decoded media of the tool results `messages`."""
    return env.decoder.decode_many(env.processor.media_refs(messages))
