"""Scripted multi-turn episodes on a real tiny checkpoint and its real Generator.

A random tiny model never writes a well-formed tool call, so only the PARSER is scripted: turn k
of an episode parses as `script[k]`, whatever was sampled. Everything else is the real path: the
engine samples the tokens and reports their logprobs, the tools write real media files (a PNG
written with Pillow, a WAV clip), and `run_episode` encodes and appends the tool results.

Each generated turn is recorded (where it starts, its tokens and logprobs), so tests can check the
Trajectory against what the generator actually produced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.sampling import SamplingParams
from areno.media.decoder import MediaDecoder
from areno.media.sources import MediaPolicy
from areno.processing.processor import Processor
from areno.protocol.responses import FunctionCall, ToolCall
from areno.rollout import Agent, ToolContext
from areno.rollout.episode import EpisodeLimits, RolloutEnv, encode_prompt_for, run_episode
from areno.rollout.trajectory import Trajectory
from areno.tools.base import ParsedToolCalls

AUDIO_RATE = 16000


@dataclass(frozen=True)
class Turn:
    """How turn k of an episode is parsed and ended.

    calls: names of the tools the turn is parsed as calling (none: a final answer).
    arguments: the JSON text of every call's arguments.
    malformed: malformed call blocks the parser reports.
    stopped: the turn ended at a stop (a call's closing tag), not at max_tokens: a generation the
        engine ended for "length" is reported as "stop" (the random model rarely samples the
        end-of-turn token, so run_episode appends it, unmasked).
    """

    calls: tuple[str, ...] = ("look",)
    arguments: str = "{}"
    malformed: int = 0
    stopped: bool = True


@dataclass(frozen=True)
class SampledTurn:
    """One generate call: where its tokens start in the episode, what it sampled."""

    start: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class ScriptedTurns:
    """The episode's generator (the real one, recorded) and its tool parser (scripted)."""

    def __init__(self, generator: Generator, script: list[Turn]):
        self.generator, self.script = generator, script
        self.sampled: list[SampledTurn] = []

    async def generate_all(self, inputs, params):
        out = await self.generator.generate_all(inputs, params)
        sample = out.samples[0]
        self.sampled.append(
            SampledTurn(
                inputs.num_prompt_tokens,
                list(sample.token_ids),
                list(sample.logprobs),
                sample.finish_reason,
            )
        )
        if sample.finish_reason == "length" and self.script[len(self.sampled) - 1].stopped:
            sample = dataclasses.replace(sample, finish_reason="stop")
            out = dataclasses.replace(out, samples=[sample])
        return out

    def parse(self, text: str, tools=None) -> ParsedToolCalls:
        turn = self.script[len(self.sampled) - 1]
        calls = [
            ToolCall(function=FunctionCall(name=n, arguments=turn.arguments)) for n in turn.calls
        ]
        return ParsedToolCalls("", calls, turn.malformed)


def _look(media: Path):
    def look(arguments: dict, ctx: ToolContext) -> list[dict]:
        out = media / f"look-{ctx.episode_index}.png"
        color = (30 * ctx.episode_index % 255, 200, 60)
        Image.new("RGB", (48, 64), color).save(out)
        return [
            {"type": "text", "text": "a closer look"},
            {"type": "image_url", "image_url": {"url": str(out)}},
        ]

    return look


def write_wav(path: Path, seconds: float, freq: float) -> Path:
    t = np.arange(int(AUDIO_RATE * seconds)) / AUDIO_RATE
    samples = (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(AUDIO_RATE)
        out.writeframes(samples.tobytes())
    return path


def _hear(media: Path):
    def hear(arguments: dict, ctx: ToolContext) -> list[dict]:
        out = write_wav(media / f"hear-{ctx.episode_index}.wav", 0.5, 440.0 + ctx.episode_index)
        return [
            {"type": "text", "text": "a sound"},
            {"type": "audio_url", "audio_url": {"url": str(out)}},
        ]

    return hear


def _submit(arguments: dict, ctx: ToolContext) -> str:
    return "answer recorded"


def _schema(name: str) -> dict:
    parameters = {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {"name": name, "description": name, "parameters": parameters},
    }


@dataclass
class ScriptedSetup:
    """A tiny checkpoint's processor, decoder and generator, the agent and the prompt."""

    checkpoint: Path
    processor: Processor
    decoder: MediaDecoder
    generator: Generator
    agent: Agent
    messages: list[dict]

    @property
    def eot(self) -> int:
        tokenizer = self.processor.tokenizer
        return int(tokenizer.convert_tokens_to_ids(self.processor.adapter.stop_tokens[0]))

    def shutdown(self) -> None:
        self.generator.shutdown()


def make_setup(checkpoint: Path, media: Path, *, max_turns: int = 3) -> ScriptedSetup:
    """The AVE shape: a prompt with an image (and an audio clip where the family takes audio),
    tools that return an image (`look`) or an audio clip (`hear`), and a final tool (`submit`)."""
    processor = Processor(checkpoint)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    engine = EngineConfig(
        max_running_prompts=2, max_context_len=4096, decode_graphs="off", decode_compile="off"
    )
    generator = Generator.from_config(checkpoint, engine)
    has_audio = "audio" in processor.adapter.modalities
    tools = {"look": _look(media), "submit": _submit}
    if has_audio:
        tools["hear"] = _hear(media)
    agent = Agent(
        tools=tools,
        tool_schemas=[_schema(name) for name in tools],
        system_prompt="Inspect the scene with the tools, then submit.",
        max_turns=max_turns,
        final_tools=("submit",),
    )
    scene = media / "scene.png"
    Image.new("RGB", (64, 48), (200, 40, 90)).save(scene)
    content: list[dict] = [{"type": "image_url", "image_url": {"url": str(scene)}}]
    if has_audio:
        clip = write_wav(media / "scene.wav", 1.0, 330.0)  # longer than `hear`: padded merge
        content.append({"type": "audio_url", "audio_url": {"url": str(clip)}})
    content.append({"type": "text", "text": "What happens here?"})
    messages = [{"role": "user", "content": content}]
    return ScriptedSetup(checkpoint, processor, decoder, generator, agent, messages)


def run_scripted(
    setup: ScriptedSetup,
    script: list[Turn],
    *,
    num_episodes: int = 1,
    temperature: float = 1.0,
    seed: int = 0,
    max_context_len: int = 4096,
    max_tokens_per_turn: int = 6,
) -> list[tuple[Trajectory, list[SampledTurn]]]:
    """`num_episodes` episodes of the setup's prompt (one at a time, so each has its own script
    position), with what each turn sampled."""
    env_base = RolloutEnv(setup.decoder, setup.processor, setup.generator, None)
    prompt = encode_prompt_for(env_base, setup.agent, setup.messages)
    sampling = SamplingParams(temperature=temperature, seed=seed)
    limits = EpisodeLimits(max_context_len, max_tokens_per_turn)
    results = []
    for index in range(num_episodes):
        scripted = ScriptedTurns(setup.generator, script)
        env = RolloutEnv(setup.decoder, setup.processor, scripted, scripted)
        ctx = ToolContext("scene", setup.messages, index)
        traj = asyncio.run(run_episode(env, setup.agent, ctx, prompt, sampling, limits))
        results.append((traj, scripted.sampled))
    return results
