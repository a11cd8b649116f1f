"""What an agent is: a system prompt, tools (Python callables), and when an episode ends.

A tool is `fn(arguments: dict, ctx: ToolContext) -> str | list[dict]`: text, or a list of content
parts in the serving format (text and media parts, e.g. a frame as an `image_url` with a worker-
local path or a data URL). Tools see the episode's PUBLIC sample only (`ctx.sample`), never its
private metadata. A tool named in `final_tools` ends the episode once called; an assistant turn
without any tool call is the final answer too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from areno.errors import ArenoError, ConfigError
from areno.imports import import_callable


class ToolNameClashError(ArenoError):
    """A sample's tools and its agent's tools share a name."""

    code = "tool_name_clash"


ToolResult = str | list[dict]


class ToolError(Exception):
    """Raised by a tool for a bad call (unknown argument, out-of-range value): the message goes
    back to the model as the tool's result, so the agent can recover."""


@dataclass(frozen=True)
class ToolContext:
    """What a tool may read: the public sample (id, messages, tools) and its episode index."""

    sample_id: str | None
    messages: list[dict]
    episode_index: int = 0

    def media_urls(self, modality: str | None = None) -> list[str]:
        """URLs (local paths, data URLs) of the media parts in the sample's messages, in order."""
        from areno.processing.messages import media_refs, validate_messages

        refs = media_refs(validate_messages(self.messages))
        return [ref.url for ref in refs if modality is None or ref.modality == modality]


@dataclass
class Agent:
    """An agent definition, shared by every episode a rollout worker runs."""

    tools: Mapping[str, Callable[[dict, ToolContext], ToolResult]] = field(default_factory=dict)
    tool_schemas: list[dict] = field(default_factory=list)  # OpenAI `tools` entries
    system_prompt: str | None = None
    max_turns: int = 1
    final_tools: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"Agent.max_turns must be at least 1, got {self.max_turns}")
        names = {schema.get("function", {}).get("name") for schema in self.tool_schemas}
        missing = sorted(set(self.tools) - names)
        if missing:
            raise ConfigError(f"Agent tools {missing} have no entry in tool_schemas")
        unknown = sorted(set(self.final_tools) - set(self.tools))
        if unknown:
            raise ConfigError(f"Agent.final_tools names tools that do not exist: {unknown}")

    def prompt_messages(self, messages: Sequence[dict]) -> list[dict]:
        """The sample's messages with the agent's system prompt first (when it has one)."""
        messages = copy.deepcopy(list(messages))
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def prompt_tools(
        self, sample_tools: Sequence[dict] | None, sample_id: str | None = None
    ) -> list[dict] | None:
        """The tools a sample's prompt offers: the agent's, then the sample's own (None when
        neither has any). Training (`areno train`) and warm starts (`areno sft`) both build
        prompts with these. Raises ToolNameClashError when one name is in both."""
        mine = {schema.get("function", {}).get("name") for schema in self.tool_schemas}
        theirs = [schema.get("function", {}).get("name") for schema in sample_tools or ()]
        clash = sorted(mine & set(theirs))
        if clash:
            raise ToolNameClashError(
                f"sample {sample_id!r} brings tools named {clash}, which its agent has too; "
                "rename them in the sample or leave them to the agent"
            )
        tools = [*copy.deepcopy(self.tool_schemas), *copy.deepcopy(list(sample_tools or ()))]
        return tools or None

    def call_tool(self, name: str, arguments: dict, ctx: ToolContext) -> list[dict] | str:
        """Run one tool; a ToolError or unknown name becomes an error text for the model."""
        fn = self.tools.get(name)
        if fn is None:
            return f"error: unknown tool {name!r}; available: {', '.join(sorted(self.tools))}"
        try:
            return fn(arguments, ctx)
        except ToolError as error:
            return f"error: {error}"


def load_agent(spec: str | None, **kwargs: Any) -> Agent:
    """The Agent that `module:callable` returns (None: a plain single-turn answerer)."""
    if not spec:
        return Agent()
    agent = import_callable(spec, "agent")(**kwargs)
    if not isinstance(agent, Agent):
        raise ConfigError(f"agent {spec!r} returned {type(agent).__name__}, not an areno Agent")
    return agent
