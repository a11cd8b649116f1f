"""What an agent program is: `run(sample, client) -> output`, or `run(sample, base_url)`.

`sample` is the episode's PUBLIC sample (`PublicSample`: id, messages, tools; private metadata
never reaches a program). `client` is an `openai.AsyncOpenAI` whose base URL is the episode's
own route (areno.programs.route); a program that builds its own client (the OpenAI Agents SDK's
`OpenAIChatCompletionsModel`, LangGraph, plain HTTP) takes `base_url` instead. Either may be an
async function or a plain one (run in a thread). What it returns is the episode's final output,
which the reward reads (`Trajectory.program_output`, and as text `Trajectory.final_text`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from areno.data.sample import PublicSample
from areno.errors import ConfigError
from areno.imports import import_callable
from areno.rollout.calls import output_text

# What the second parameter of a program is named decides what it is given.
TAKES = ("client", "base_url")
# The key a program's client sends: the route takes any (the episode id is the secret).
EPISODE_API_KEY = "areno-episode"


@dataclass(frozen=True)
class Program:
    """A loaded agent program and what its second argument is (`TAKES`)."""

    fn: Callable[..., Any]
    takes: str

    async def run(self, sample: PublicSample, base_url: str) -> Any:
        """One episode of the program on the route at `base_url`; its final output."""
        if self.takes == "base_url":
            return await _call(self.fn, sample, base_url)
        import openai

        http_client = openai.DefaultAsyncHttpxClient(verify=_tls_context())
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key=EPISODE_API_KEY, http_client=http_client
        )
        try:
            return await _call(self.fn, sample, client)
        finally:
            await client.close()


def load_program(spec: str) -> Program:
    """The program `module:callable` names; refuses one whose parameters are not
    (sample, client) or (sample, base_url), naming the setting."""
    fn = import_callable(spec, "rollout.program")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params]
    if len(params) != 2 or names[1] not in TAKES:
        raise ConfigError(
            f"rollout.program {spec!r} takes ({', '.join(names)}); an agent program takes "
            "(sample, client) or (sample, base_url)",
            param="rollout.program",
        )
    return Program(fn, names[1])


def portable_output(output: Any) -> Any:
    """The output as it travels to the trainer: itself when it is plain JSON data, its text
    otherwise (an SDK's result object may hold clients and locks that do not pickle)."""
    try:
        json.dumps(output)
    except (TypeError, ValueError):
        return output_text(output)
    return output


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The TLS context of every episode's client on this worker, built once.

    NOTE: an httpx client built without one loads the system's CA certificates: 16.6 ms of CPU
    a client (128 clients: 2.13 s, against 0.004 s sharing a context), that is 2 s a step of
    the Agents SDK color quiz's 128 episodes, on the rollout worker's event loop. (The route is
    plain HTTP on loopback; the context is never used, only built.) Each episode keeps a
    connection pool of its own: one pool for a step's 128 concurrent episodes was slower."""
    return ssl.create_default_context()


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    return await result if inspect.isawaitable(result) else result
