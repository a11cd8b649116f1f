"""An agent program for the tests, written with the official `openai` client as a user would:
the color quiz with one function tool. Its episode makes four calls:

1. the quiz, the tool forced (`tool_choice: required`; an enum argument, so even a random tiny
   model completes the call through the grammar): a tool call round trip;
2. the history extended with the call and the tool's result: a one-token reply;
3. the history extended with that reply and a follow-up question: a one-token reply (this call
   extends the last one's prompt and reply whenever the template writes the reply back as the
   engine's tokens were);
4. the history REWRITTEN: a new system prompt before the quiz alone, which never extends call 3.

What the program saw (its public sample, each reply's `token_ids` and `prompt_token_ids` as the
API reported them) is appended to `program-log.jsonl` beside the sample's image; the reward
appends what it saw to `reward_kwargs["log"]`. The test compares the two.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.train.canary_task import CANARY

TOOL = {
    "type": "function",
    "function": {
        "name": "note_option",
        "description": "Note the option you lean to before answering.",
        "parameters": {
            "type": "object",
            "properties": {"letter": {"type": "string", "enum": ["A", "B", "C", "D"]}},
            "required": ["letter"],
            "additionalProperties": False,
        },
    },
}
IDS = {"return_token_ids": True}


async def run(sample, client):
    messages = list(sample.messages)
    seen = []
    first = await client.chat.completions.create(
        model="policy",
        messages=messages,
        tools=[TOOL],
        tool_choice="required",
        max_tokens=48,
        extra_body=IDS,
    )
    seen.append(_ids(first))
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    for call in reply.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "noted"})
    second = await client.chat.completions.create(
        model="policy", messages=messages, tools=[TOOL], max_tokens=1, extra_body=IDS
    )
    seen.append(_ids(second))
    messages.append({"role": "assistant", "content": second.choices[0].message.content or ""})
    messages.append({"role": "user", "content": "Your final letter?"})
    third = await client.chat.completions.create(
        model="policy", messages=messages, tools=[TOOL], max_tokens=1, extra_body=IDS
    )
    seen.append(_ids(third))
    rewritten = [{"role": "system", "content": "Answer with one letter."}, *sample.messages]
    fourth = await client.chat.completions.create(
        model="policy", messages=rewritten, max_tokens=1, extra_body=IDS
    )
    seen.append(_ids(fourth))
    _log(sample, {"sample": sample.to_dict(), "tool_calls": len(reply.tool_calls or []),
                  "calls": seen})  # fmt: skip
    return fourth.choices[0].message.content or ""


def _ids(response) -> dict:
    choice = response.choices[0]
    return {
        "prompt_token_ids": response.model_extra["prompt_token_ids"],
        "token_ids": choice.model_extra["token_ids"],
    }


def _log(sample, line: dict) -> None:
    image = sample.messages[0]["content"][0]["image_url"]["url"]
    with open(Path(image).parent / "program-log.jsonl", "a") as out:
        out.write(json.dumps(line) + "\n")


def reward(trajectory, private: dict, log: str) -> dict[str, float]:
    """The color quiz's reward on the program's final output, after logging what it saw."""
    from areno.tasks import color_quiz

    line = {
        "sample_id": trajectory.sample_id,
        "episode": trajectory.episode_index,
        "part": trajectory.part,
        "num_parts": trajectory.num_parts,
        "token_ids": trajectory.token_ids,
        "loss_mask": trajectory.loss_mask,
        "finish": trajectory.finish,
        "final_text": trajectory.final_text,
        "output": trajectory.program_output,
        "private_canary": private.get("canary") == CANARY,
        "calls": [
            {"prompt_ids": c.prompt_ids, "token_ids": c.token_ids, "messages": c.messages}
            for c in trajectory.calls
        ],
    }
    with open(log, "a") as out:
        out.write(json.dumps(line) + "\n")
    return color_quiz.reward(trajectory, private)
