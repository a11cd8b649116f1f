"""What the Ingress reports of each chat request: Prometheus metrics, exported by Ray next to
Serve's own, and with ARENO_LOG_COMPLETIONS=1 one log line per finished completion."""

from __future__ import annotations

import json
import logging
import time

from areno.logs import completions_logged
from areno.serve.chat import PreparedChat

# A child of "ray.serve": Serve routes it to the replica's log file and the driver's console.
completion_logger = logging.getLogger("ray.serve.areno.completions")


class IngressMetrics:
    """Prometheus metrics of the OpenAI route, exported by Ray next to Serve's own."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.requests = metrics.Counter(
            "areno_requests", "Chat completion requests by HTTP status.", tag_keys=("status",)
        )
        self.prompt_tokens = metrics.Counter("areno_prompt_tokens", "Encoded prompt tokens.")
        self.completion_tokens = metrics.Counter("areno_completion_tokens", "Generated tokens.")
        self.malformed_tool_calls = metrics.Counter(
            "areno_malformed_tool_calls", "Tool-call text that did not parse (returned as content)."
        )
        self.time_to_first_token = metrics.Histogram(
            "areno_time_to_first_token_s",
            "Seconds from request arrival to the first generated token.",
            boundaries=[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
        )
        self.tokens_per_s = metrics.Histogram(
            "areno_output_tokens_per_s",
            "Generated tokens per second of each request after its first token.",
            boundaries=[1, 5, 10, 25, 50, 100, 250, 500, 1000],
        )

    def record(
        self, prepared: PreparedChat, body: dict, first_token_at: float, malformed: int
    ) -> None:
        """Metrics of a finished request, and its log line with ARENO_LOG_COMPLETIONS=1."""
        num_prompt_tokens = prepared.inputs.num_prompt_tokens
        usage = body.get("usage") or {}
        completion_tokens = usage.get("completion_tokens", 0)
        elapsed = time.perf_counter() - first_token_at
        self.requests.inc(tags={"status": "200"})
        self.prompt_tokens.inc(num_prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if malformed:
            self.malformed_tool_calls.inc(malformed)
        if completion_tokens > 1 and elapsed > 0:
            self.tokens_per_s.observe((completion_tokens - 1) / elapsed)
        if completions_logged():
            line = _log_line(body, num_prompt_tokens, completion_tokens, malformed)
            request = prepared.request
            # The caller's own labels, so a logged completion can be traced to its user.
            line |= {k: v for k, v in (("user", request.user), ("metadata", request.metadata)) if v}
            completion_logger.info("completion %s", json.dumps(line, ensure_ascii=False))


def _log_line(body: dict, num_prompt_tokens: int, completion_tokens: int, malformed: int) -> dict:
    """The completion's log record: its counts and each choice's reasoning, content, calls."""
    choices = [
        {
            "index": c["index"],
            "reasoning_content": c["message"].get("reasoning_content"),
            "content": c["message"].get("content"),
            "tool_calls": [
                {"name": t["function"]["name"], "arguments": t["function"]["arguments"]}
                for t in c["message"].get("tool_calls") or []
            ],
            "finish_reason": c["finish_reason"],
        }
        for c in body["choices"]
    ]
    return {
        "id": body.get("id"),
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion_tokens,
        "malformed_tool_calls": malformed,
        "choices": choices,
    }
