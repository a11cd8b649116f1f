"""Agents written with the OpenAI Agents SDK (`openai-agents`, the extra `agents`) run against the
served tiny Gemma 4 as they run against OpenAI: through the SDK's default Responses model and
its Chat Completions model, each made to call a function tool whose arguments the SDK parses and
runs, the run ending with the tool's output. Tracing is off: nothing leaves loopback."""

from __future__ import annotations

import asyncio
from typing import Literal

import openai
import pytest

agents = pytest.importorskip("agents", reason="the Agents SDK: pip install -e '.[agents]'")


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agents_sdk_agent_calls_a_function_tool(server, api):
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def pan(direction: Literal["left", "right"], steps: Literal[1, 2, 3]) -> str:
        """Pan the camera.

        Args:
            direction: where to.
            steps: how far.
        """
        calls.append((direction, steps))
        return f"panned {direction} by {steps}"

    client = openai.AsyncOpenAI(base_url=str(server.base_url), api_key="unused")
    model = {
        "responses": agents.OpenAIResponsesModel,
        "chat_completions": agents.OpenAIChatCompletionsModel,
    }[api](model="tiny-gemma4", openai_client=client)
    agent = agents.Agent(
        name="camera",
        instructions="Pan the camera when asked.",
        tools=[pan],
        model=model,
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(agents.Runner.run(agent, "Pan the camera a little to the left."))
    [(direction, steps)] = calls
    assert direction in {"left", "right"} and steps in {1, 2, 3}
    assert result.final_output == f"panned {direction} by {steps}"
