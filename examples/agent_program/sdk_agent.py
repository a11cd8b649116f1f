"""The color quiz agent written with the OpenAI Agents SDK, trained as it is with `areno train`.

Two SDK agents in a row on the one policy, with one function tool between them: `lookup` reads
the question and must call `list_options` (the SDK runs it and ends that agent's run with its
result); `answer` is then shown the image, the question and the options it looked up, and
replies with one letter. The SDK talks to the model through its Chat Completions model on the
client `areno train` gives the episode; the same function is the evaluation, given a client of
`areno serve` of the trained checkpoint.

Both agents' calls are trained. `answer` starts a new conversation, so the episode is two
transitions, each carrying its reward (docs/agent-programs.md says why the answer is not asked
in the lookup's conversation on the tiny CPU checkpoint).

    pip install -e '.[agents]'
    areno train --config examples/agent_program/sdk_agent.yaml --model-path runs/warm
"""

from __future__ import annotations

import json

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from examples.agent_program.color_agent import options

# The SDK sends traces to OpenAI unless told not to; a rollout worker keeps its traffic local.
set_tracing_disabled(True)
# Qwen3.5's template opens a reasoning block unless told not to: the answer is the reply itself.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


async def run(sample, client) -> str:
    """One episode: `lookup`'s forced tool call, then `answer`'s letter (the final output)."""
    image, question = sample.messages[0]["content"]

    @function_tool
    def list_options() -> str:
        """The answer options of the quiz, as letter: color name."""
        return json.dumps(options(question["text"]))

    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    lookup = Agent(
        name="lookup",
        tools=[list_options],
        model=model,
        model_settings=ModelSettings(tool_choice="list_options", extra_body=NO_THINKING),
        tool_use_behavior="stop_on_first_tool",
    )
    answer = Agent(name="answer", model=model, model_settings=ModelSettings(extra_body=NO_THINKING))
    looked_up = await Runner.run(lookup, question["text"])
    shown = {"role": "user", "content": [
        {"type": "input_image", "image_url": image["image_url"]["url"]},
        {"type": "input_text", "text": f"{question['text']} Options: {looked_up.final_output}"},
    ]}  # fmt: skip
    result = await Runner.run(answer, [shown])
    return result.final_output
