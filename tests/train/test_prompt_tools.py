"""`areno sft` and `areno train` build the same prompt for a sample: the agent's system prompt,
its tools and the sample's own tools, on the one processor path."""

from __future__ import annotations

import pytest

from areno.data import Sample
from areno.media import MediaDecoder, MediaPolicy
from areno.media.samples import write_image
from areno.processing import Processor
from areno.rollout.agent import Agent, ToolNameClashError
from areno.rollout.episode import RolloutEnv, encode_prompt_for
from areno.train.sft import _encode


def _tool(name: str) -> dict:
    parameters = {"type": "object", "properties": {"x": {"type": "number"}}}
    return {
        "type": "function",
        "function": {"name": name, "description": f"The {name} tool.", "parameters": parameters},
    }


def _agent() -> Agent:
    return Agent(
        tools={"zoom": lambda arguments, ctx: "zoomed"},
        tool_schemas=[_tool("zoom")],
        system_prompt="You look closely before you answer.",
        max_turns=2,
    )


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_sft_and_rollouts_encode_the_same_prompt_with_the_samples_tools(
    tiny_path, tmp_path, family
):
    processor = Processor(tiny_path(family))
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    image = str(write_image(tmp_path / "a.png", 64, 48))
    content = [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": "How many shapes?"},
    ]
    sample = Sample([{"role": "user", "content": content}], tools=[_tool("count")], id="s1")
    agent = _agent()
    trained, num_prompt = _encode(processor, decoder, sample, "Three.", agent)
    env = RolloutEnv(decoder, processor, None, None)
    rolled = encode_prompt_for(env, agent, sample.public().messages, sample.public().tools, "s1")
    assert trained.input_ids[:num_prompt] == rolled.input_ids
    assert rolled.prompt_text.count('"count"') == rolled.prompt_text.count('"zoom"') == 1
    without = encode_prompt_for(env, agent, sample.public().messages)
    assert without.num_prompt_tokens < rolled.num_prompt_tokens  # the sample's tool is in


def test_a_sample_tool_named_like_an_agent_tool_is_refused():
    with pytest.raises(ToolNameClashError, match=r"sample 's2' brings tools named \['zoom'\]"):
        _agent().prompt_tools([_tool("zoom"), _tool("count")], "s2")
    assert _agent().prompt_tools(None) == [_tool("zoom")]
    assert Agent().prompt_tools(None) is None
