"""The training route (areno.programs.route) on a real tiny Gemma 4 and its Generator, called
with the official `openai` client over loopback HTTP: a tool call round trip is recorded as the
engine ran it (the ids the API reports), a request that asks for another distribution, more
tokens or more calls is refused with a 4xx naming the field while the route keeps serving, and
an episode's route takes no call once its episode ended. Also: an agent program's signature and
the leak guard on what a program sends."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest

from areno.data import Sample
from areno.data.guard import PrivateDataLeakError
from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.sampling import SamplingParams
from areno.errors import ConfigError
from areno.media.decoder import MediaDecoder
from areno.media.sources import MediaPolicy
from areno.processing.processor import Processor
from areno.programs.program import load_program
from areno.programs.route import EpisodeRoute, RouteLimits
from areno.rollout.calls import ProgramEpisode, trajectories_from_calls
from areno.rollout.episode import RolloutEnv
from areno.tools.registry import get_tool_parser
from areno.train.controller import check_program_calls
from tests.programs.quiz_program import TOOL

QUIZ = [{"role": "user", "content": "Which option? A, B, C or D."}]


@pytest.fixture(scope="module")
def env(tiny_path):
    checkpoint = tiny_path("gemma4")
    processor = Processor(checkpoint)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    engine = EngineConfig(
        max_running_prompts=2, max_context_len=1024, decode_graphs="off", decode_compile="off"
    )
    generator = Generator.from_config(checkpoint, engine)
    yield RolloutEnv(decoder, processor, generator, get_tool_parser(processor.adapter.tool_format))
    generator.shutdown()


def _on_route(env, limits: RouteLimits, program):
    """Run `program(client, episode, route)` against a fresh route; the episode it recorded."""

    async def main():
        route = EpisodeRoute(env, limits)
        await route.start()
        episode = ProgramEpisode(0)
        base_url = route.open(episode, SamplingParams(temperature=1.0, seed=5))
        try:
            async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as c:
                await program(c, base_url, route)
        finally:
            await route.stop()
        return episode

    return asyncio.run(main())


def test_a_tool_round_trip_is_recorded_with_the_ids_the_api_reports(env):
    reported = []

    async def program(client, base_url, route):
        messages = list(QUIZ)
        first = await client.chat.completions.create(
            model="any", messages=messages, tools=[TOOL], tool_choice="required",
            max_tokens=48, extra_body={"return_token_ids": True},
        )  # fmt: skip
        reply = first.choices[0].message
        assert reply.tool_calls and reply.tool_calls[0].function.name == "note_option"
        messages += [reply.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "ok"}]
        second = await client.chat.completions.create(
            model="any", messages=messages, tools=[TOOL], max_tokens=4,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        for response in (first, second):
            ids = response.model_extra["prompt_token_ids"], response.choices[0].model_extra
            reported.append((ids[0], ids[1]["token_ids"]))

    episode = _on_route(env, RouteLimits(64, 4), program)
    assert [(c.prompt_ids, c.token_ids) for c in episode.calls] == reported
    first, second = episode.calls
    assert first.tool_calls[0]["name"] == "note_option"
    assert [m["role"] for m in second.messages] == ["user", "assistant", "tool"]
    assert all(
        len(c.logprobs) == len(c.token_ids) == len(c.token_versions) for c in (first, second)
    )
    parts = trajectories_from_calls("s", episode)
    sampled = [t for p in parts for t, m in zip(p.token_ids, p.loss_mask, strict=True) if m]
    assert sampled == first.token_ids + second.token_ids


def test_refusals_name_the_field_and_the_route_keeps_serving(env):
    async def program(client, base_url, route):
        refused = {
            "temperature": {"temperature": 0.2},
            "seed": {"seed": 1},
            "n": {"n": 2},
            "stream": {"stream": True},
            "max_tokens": {"max_tokens": 9},
            "repetition_penalty": {"extra_body": {"repetition_penalty": 1.3}},
        }
        for field, kwargs in refused.items():
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="any", messages=QUIZ, **kwargs)
            assert caught.value.body["param"] == field, caught.value.body
        await client.chat.completions.create(model="any", messages=QUIZ, max_tokens=2)
        await client.chat.completions.create(model="any", messages=QUIZ, temperature=1.0)
        with pytest.raises(openai.RateLimitError, match="rollout.program_max_calls"):
            await client.chat.completions.create(model="any", messages=QUIZ)
        route.close(base_url)
        with pytest.raises(openai.NotFoundError, match="no open episode"):
            await client.chat.completions.create(model="any", messages=QUIZ)

    episode = _on_route(env, RouteLimits(8, 2), program)
    assert len(episode.calls) == 2  # only the calls that ran are recorded


def test_groups_that_start_the_route_at_once_all_get_its_url(env):
    """A step's (or an evaluation's) groups reach a fresh worker together: each waits for the
    one server, and none opens an episode before its URL is known."""

    async def main():
        route = EpisodeRoute(env, RouteLimits(4, 1))
        try:
            urls = await asyncio.gather(*(route.start() for _ in range(8)))
            return urls, route.open(ProgramEpisode(0), SamplingParams())
        finally:
            await route.stop()

    urls, episode_url = asyncio.run(main())
    assert len(set(urls)) == 1 and urls[0].startswith("http://127.0.0.1:")
    assert episode_url.startswith(urls[0] + "/episodes/")


async def _takes_client(sample, client): ...


def _takes_url(sample, base_url): ...


def _takes_other(sample, session): ...


def test_a_program_takes_a_client_or_a_base_url():
    assert load_program(f"{__name__}:_takes_client").takes == "client"
    assert load_program(f"{__name__}:_takes_url").takes == "base_url"
    with pytest.raises(ConfigError, match=r"takes \(sample, session\); an agent program takes"):
        load_program(f"{__name__}:_takes_other")


def test_the_leak_guard_reads_what_the_program_sent():
    from areno.rollout.trajectory import RecordedCall, Trajectory

    sample = Sample(QUIZ, private={"answer": "zebra"}, id="s1")
    said = [{"role": "user", "content": "is it a zebra?"}]
    wrote = [{"role": "assistant", "content": "a zebra"}]  # the policy's own words: not a leak
    traj = Trajectory("s1", 0, None, 0, [], [], [])
    traj.calls = [RecordedCall([1], [2], [0.0], [0], 0, "stop", QUIZ + wrote)]
    check_program_calls(traj, sample)
    traj.calls.append(RecordedCall([1], [2], [0.0], [0], 0, "stop", said))
    with pytest.raises(PrivateDataLeakError, match="agent program, episode 0, call 1"):
        check_program_calls(traj, sample)


def test_the_example_agent_runs_its_tool_round_trip(env, tmp_path):
    from areno.tasks.color_quiz import load
    from examples.agent_program.color_agent import run

    sample = next(load(num_samples=1, media_dir=tmp_path)).public()
    output = []

    async def program(client, base_url, route):
        output.append(await run(sample, client))

    episode = _on_route(env, RouteLimits(32, 4), program)
    first, second = episode.calls
    assert [c["name"] for c in first.tool_calls] == ["list_options"]
    assert second.messages[-1]["role"] == "tool" and "green" in second.messages[-1]["content"]
    assert isinstance(output[0], str) and len(second.token_ids) == 1


def test_the_agents_sdk_example_samples_only_its_letter_on_the_route(env, tmp_path):
    """examples/agent_program/sdk_agent.py on the route: the agent's forced `answer` call shows
    the image and the question; the model samples the letter alone (the server writes the rest
    of the call: areno.tools.choice_call), the SDK runs the tool, and its letter is the final
    output. One call, one trajectory, one trained token."""
    pytest.importorskip("agents", reason="the Agents SDK: pip install -e '.[agents]'")
    from areno.tasks.color_quiz import load
    from examples.agent_program.sdk_agent import run

    sample = next(load(num_samples=1, media_dir=tmp_path)).public()
    output = []

    async def program(client, base_url, route):
        output.append(await run(sample, client))

    episode = _on_route(env, RouteLimits(1, 2), program)
    [call] = episode.calls
    [made] = call.tool_calls
    assert made["name"] == "answer" and len(call.token_ids) == 1
    assert output == [json.loads(made["arguments"])["letter"]] and output[0] in "ABCD"
    [shown] = [m for m in call.messages if m["role"] == "user"]
    image, text = shown["content"]
    assert image["type"] == "image_url" and text["text"] == sample.messages[0]["content"][1]["text"]
    [traj] = trajectories_from_calls(sample.id, episode)
    assert sum(traj.loss_mask) == 1


def test_the_docs_show_the_agents_sdk_example_as_it_is():
    """docs/agent-programs.md's snippet is the example's code, which the test above runs."""
    from tests.readme import REPO, blocks

    snippets = [b.text for b in blocks(REPO / "docs" / "agent-programs.md") if b.lang == "python"]
    example = (REPO / "examples" / "agent_program" / "sdk_agent.py").read_text()
    assert len(snippets) == 1 and snippets[0] in example


def test_an_agents_sdk_agent_runs_on_the_route_and_its_call_is_recorded(env):
    """An agent written with the OpenAI Agents SDK (its Chat Completions model, sampling left
    to the run) runs against the route unchanged: its forced tool call is parsed and run by the
    SDK, and the route recorded the call as the engine ran it."""
    agents = pytest.importorskip("agents", reason="the Agents SDK: pip install -e '.[agents]'")
    agents.set_tracing_disabled(True)
    noted = []

    @agents.function_tool
    def note_option(option: Literal["A", "B", "C", "D"]) -> str:
        """Note the chosen option.

        Args:
            option: the letter.
        """
        noted.append(option)
        return f"noted {option}"

    async def program(client, base_url, route):
        agent = agents.Agent(
            name="quiz",
            instructions="Answer with one letter.",
            tools=[note_option],
            model=agents.OpenAIChatCompletionsModel(model="policy", openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", max_tokens=48),
            tool_use_behavior="stop_on_first_tool",
        )
        result = await agents.Runner.run(agent, QUIZ[0]["content"])
        assert result.final_output == f"noted {noted[0]}"

    episode = _on_route(env, RouteLimits(64, 4), program)
    [call] = episode.calls
    assert call.tool_calls[0]["name"] == "note_option" and len(noted) == 1
    assert call.token_ids and len(call.logprobs) == len(call.token_ids)
    assert any(m.get("content") == QUIZ[0]["content"] for m in call.messages)
