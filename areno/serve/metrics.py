"""What the Ingress reports of each chat or text completion request: Prometheus metrics,
exported by Ray next to Serve's own, and with ARENO_LOG_COMPLETIONS=1 one log line per finished
completion."""

from __future__ import annotations

import hashlib
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
            "areno_requests", "Completion requests by HTTP status.", tag_keys=("status",)
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
        """Metrics of a finished chat request, and its log line with ARENO_LOG_COMPLETIONS=1."""
        num_prompt_tokens = prepared.inputs.num_prompt_tokens
        completion_tokens = (body.get("usage") or {}).get("completion_tokens", 0)
        self._count(num_prompt_tokens, completion_tokens, first_token_at)
        if malformed:
            self.malformed_tool_calls.inc(malformed)
        if completions_logged():
            line = _log_line(body, num_prompt_tokens, completion_tokens, malformed)
            line |= caller_digests(prepared.request.user, prepared.request.metadata)
            completion_logger.info("completion %s", json.dumps(line, ensure_ascii=False))

    def record_text_completion(self, body: dict, first_token_at: float) -> None:
        """The same for a text completion (`/v1/completions`): its body, or the summary of
        what was streamed ({id, choices [{index, text, finish_reason}], usage})."""
        usage = body["usage"]
        self._count(usage["prompt_tokens"], usage["completion_tokens"], first_token_at)
        if completions_logged():
            choices = [
                {key: c[key] for key in ("index", "text", "finish_reason")} for c in body["choices"]
            ]
            line = {
                "id": body["id"],
                **{k: usage[k] for k in ("prompt_tokens", "completion_tokens")},
            }
            line["choices"] = choices
            completion_logger.info("completion %s", json.dumps(line, ensure_ascii=False))

    def _count(self, num_prompt_tokens: int, completion_tokens: int, first_token_at: float) -> None:
        elapsed = time.perf_counter() - first_token_at
        self.requests.inc(tags={"status": "200"})
        self.prompt_tokens.inc(num_prompt_tokens)
        if completion_tokens:  # a Ray counter refuses 0 (a prompt only scored generates none)
            self.completion_tokens.inc(completion_tokens)
        if completion_tokens > 1 and elapsed > 0:
            self.tokens_per_s.observe((completion_tokens - 1) / elapsed)


def caller_digests(user: str | None, metadata: dict | None) -> dict:
    """The caller's `user` and `metadata` as digests: a client finds its logged completions by
    hashing its own labels, and the log never holds them (they may be private: invariant 4)."""

    def digest(value: object) -> str:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    labels = {"user_digest": user, "metadata_digest": metadata}
    return {key: digest(value) for key, value in labels.items() if value}


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
