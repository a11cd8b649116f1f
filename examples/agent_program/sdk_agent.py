"""The color quiz agent written with the OpenAI Agents SDK, trained as it is with `areno train`.

One SDK agent with one function tool, `answer(letter)`: the agent is shown the image and the
question and must call the tool (a named `tool_choice`); the SDK runs it and ends the run with
its result, the letter, which is the episode's final output. The letter's parameter lists its
values, so the server writes the whole call but the letter itself: the one token the model
samples and the trainer trains, as in the plain quiz (docs/agent-programs.md). The SDK talks to
the model through its Chat Completions model on the client `areno train` gives the episode; the
same function is the evaluation, given a client of `areno serve` of the trained checkpoint.

    pip install -e '.[agents]'
    areno train --config examples/agent_program/sdk_agent.yaml --model-path runs/warm
"""

from __future__ import annotations

from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

# The SDK sends traces to OpenAI unless told not to; a rollout worker keeps its traffic local.
set_tracing_disabled(True)
# Qwen3.5's template opens a reasoning block unless told not to: the answer is the call itself.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@function_tool
def answer(letter: Literal["A", "B", "C", "D"]) -> str:
    """Answer the quiz."""
    return letter


async def run(sample, client) -> str:
    """One episode: the agent's forced `answer` call; its letter is the final output."""
    image, question = sample.messages[0]["content"]
    agent = Agent(
        name="quiz",
        tools=[answer],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(tool_choice="answer", extra_body=NO_THINKING),
        tool_use_behavior="stop_on_first_tool",
    )
    shown = {"role": "user", "content": [
        {"type": "input_image", "image_url": image["image_url"]["url"]},
        {"type": "input_text", "text": question["text"]},
    ]}  # fmt: skip
    result = await Runner.run(agent, [shown])
    return result.final_output
