"""The Gemma 4 server's clients: a chat request or a completion with the tests' defaults (greedy,
a few tokens, the served model), a client of the guarded app, and a response's completion log."""

from __future__ import annotations

import glob
import json
import time
from pathlib import Path

import openai
import ray

MAX_PROMPT_TOKENS = 900
GUARDED_MAX_QUEUED = 1  # the guarded app: 2 running + 1 waiting, then 429
API_KEY = "sk-test-key"


def ask(client, content, **kwargs):
    return client.chat.completions.create(
        model=kwargs.pop("model", "tiny-gemma4"),
        messages=[{"role": "user", "content": content}],
        max_tokens=kwargs.pop("max_tokens", 8),
        temperature=kwargs.pop("temperature", 0),
        **kwargs,
    )


def guarded_client(server, key: str | None = API_KEY) -> openai.OpenAI:
    base = str(server.base_url).rstrip("/").removesuffix("/v1")
    return openai.OpenAI(base_url=f"{base}/guarded/v1", api_key=key or "wrong", max_retries=0)


def ingress_log(waiting_for: str) -> str:
    """The Ingress replica's log, read again for up to 10 s until it holds `waiting_for` (the
    replica writes its log file a moment after it logs)."""
    session = ray._private.worker._global_node.get_session_dir_path()
    for _ in range(50):
        logs = "".join(
            Path(p).read_text(errors="replace")
            for p in glob.glob(f"{session}/logs/serve/replica_areno_Ingress_*.log")
        )
        if waiting_for in logs:
            break
        time.sleep(0.2)
    return logs


def completion_log(response_id: str) -> dict:
    """The ARENO_LOG_COMPLETIONS record of a response, read from the Ingress replica's log."""
    logs = ingress_log(response_id)
    line = next(x for x in logs.splitlines() if response_id in x)
    record, _ = json.JSONDecoder().raw_decode(line, line.index("completion {") + len("completion "))
    return record


def complete(client, prompt, **kwargs):
    return client.completions.create(
        model=kwargs.pop("model", "tiny-gemma4"),
        prompt=prompt,
        max_tokens=kwargs.pop("max_tokens", 6),
        temperature=kwargs.pop("temperature", 0),
        **kwargs,
    )
