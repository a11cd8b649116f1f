"""An agent written with the official `openai` client, trained as it is with `areno train`.

It solves the built-in color quiz (areno/tasks/color_quiz.py) with one function tool: it first
looks up the options (`list_options`, run here in the program), then answers with one letter.
The same function is the evaluation: point `run` at `areno serve` of the trained checkpoint.

    areno train --config examples/agent_program/color_agent.yaml
"""

from __future__ import annotations

import json
import re

OPTIONS_TOOL = {
    "type": "function",
    "function": {
        "name": "list_options",
        "description": "The answer options of the quiz, as letter: color name.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


def options(question: str) -> dict[str, str]:
    """The lettered options a color quiz question lists ("Options: A red, B green, ...")."""
    return dict(re.findall(r"\b([A-H]) ([a-z]+)", question.split("Options:")[-1]))


async def run(sample, client) -> str:
    """One episode: a tool call round trip, then the answer (the episode's final output)."""
    messages = list(sample.messages)
    first = await client.chat.completions.create(
        model="policy", messages=messages, tools=[OPTIONS_TOOL], tool_choice="required"
    )
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    question = messages[0]["content"][-1]["text"]
    for call in reply.tool_calls or []:
        result = json.dumps(options(question))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = await client.chat.completions.create(model="policy", messages=messages, max_tokens=1)
    return answer.choices[0].message.content or ""
