"""Routing across two Generator replicas of a live app (`--world-size 2`), through the official
`openai` client: with `--routing prefix` prompts that share a long prefix all go to the replica
that holds it, whose prefix cache then serves it, while prompts with nothing in common spread
over both replicas; with `--routing round_robin` the same prompts alternate and each replica
computes the prefix for itself. Each replica's counters come from the replica itself
(`GeneratorServer.replica_stats`, broadcast to every replica).

The tiny Qwen3-VL: its text stack is attention only, so a prompt resumes after any cached
block of its prefix (a linear-attention model resumes only at saved states)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import urllib.error
import urllib.request

import openai
import pytest
from ray import serve

from areno.engine.config import EngineConfig
from areno.serve.config import ServeConfig
from tests.serve.live.apps import deployed

MODEL = "tiny-route"
# A prefix of several hundred tokens: many full blocks, the same in every prompt.
PREFIX = "Here is the shared report. " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(80))
NUM_REPEATS = 6


@pytest.fixture(scope="module")
def config(serve_port, tiny_path) -> ServeConfig:
    return ServeConfig(
        model_path=str(tiny_path("qwen3_vl")),
        served_model_name=MODEL,
        port=serve_port,
        engine=EngineConfig(max_running_prompts=4, max_context_len=2048),
        world_size=2,
        num_cpus_per_deployment=0.1,
        routing="prefix",
    )


def _replica_counts(app: str) -> dict[str, tuple[int, int]]:
    """Each Generator replica's prompt tokens admitted and, of them, held by its cache."""
    handle = serve.get_deployment_handle("GeneratorServer", app_name=app)
    replies = handle.broadcast("replica_stats").results(timeout_s=60)
    return {
        replica: (stats["num_prompt_tokens_admitted"], stats["num_prompt_tokens_cached"])
        for replica, stats in replies
    }


def _grown(before: dict, after: dict) -> dict[str, tuple[int, int]]:
    return {r: (after[r][0] - before[r][0], after[r][1] - before[r][1]) for r in after}


def _ask(client: openai.OpenAI, text: str) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2, temperature=0
    )
    assert reply.choices[0].message is not None


def _repeat_prefix(client: openai.OpenAI) -> None:
    """The shared prefix sent NUM_REPEATS times, one request after the other, each with a
    question of its own."""
    for i in range(NUM_REPEATS):
        _ask(client, f"{PREFIX}\nQuestion {i}: what is item {i}?")


def _app(name: str, prefix: str, config: ServeConfig, serve_port: int):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}{prefix}/v1", api_key="none")
    return deployed((name, prefix, config)), client


def _ready(serve_port: int, prefix: str, timeout_s: float = 180) -> None:
    """Until the app's /health answers 200: its Ingress has sent its own first requests
    (areno/serve/first_requests.py), which would otherwise land among the counted ones."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{serve_port}{prefix}/health") as reply:
                if reply.status == 200:
                    return
        except urllib.error.URLError:
            pass
        assert time.monotonic() < deadline, f"{prefix}: /health not 200 after {timeout_s} s"
        time.sleep(0.5)


def test_prefix_routing_keeps_a_shared_prefix_on_the_replica_that_holds_it(config, serve_port):
    context, client = _app("route-prefix", "/prefix", config, serve_port)
    with context:
        _ready(serve_port, "/prefix")
        assert len(_replica_counts("route-prefix")) == 2
        before = _replica_counts("route-prefix")
        _repeat_prefix(client)
        grown = _grown(before, _replica_counts("route-prefix"))
        used = [r for r, (admitted, _) in grown.items() if admitted]
        assert len(used) == 1, grown  # every request on one replica
        admitted, cached = grown[used[0]]
        # Every request after the first finds the prefix there: its cached-token count grew by
        # most of the later prompts.
        assert cached >= 0.8 * admitted * (NUM_REPEATS - 1) / NUM_REPEATS, grown

        # Prompts with nothing in common are spread by load: both replicas take some.
        before = _replica_counts("route-prefix")
        distinct = [f"Topic {i}: " + f"word{i} " * (40 + 9 * i) for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda text: _ask(client, text), distinct))
        grown = _grown(before, _replica_counts("route-prefix"))
        assert all(admitted > 0 for admitted, _ in grown.values()), grown


def test_round_robin_spreads_the_prefix_and_each_replica_computes_it(config, serve_port):
    rr = dataclasses.replace(config, routing="round_robin")
    context, client = _app("route-rr", "/rr", rr, serve_port)
    with context:
        _ready(serve_port, "/rr")
        before = _replica_counts("route-rr")
        _repeat_prefix(client)
        grown = _grown(before, _replica_counts("route-rr"))
        assert all(admitted > 0 for admitted, _ in grown.values()), grown  # both served it
        # Each replica prefilled the prefix itself: at least most of one prompt computed on each.
        prompt_tokens = sum(admitted for admitted, _ in grown.values()) / NUM_REPEATS
        for admitted, cached in grown.values():
            assert admitted - cached >= 0.8 * prompt_tokens, grown
