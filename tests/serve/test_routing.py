"""The prefix router's books and choice (areno/serve/prefix_index.py), its key against the
engine's own block hashes, and the routing setting (`--routing`). The live routing of two
Generator replicas is tests/serve/live/test_routing.py."""

from __future__ import annotations

import random

import pytest

from areno.engine.config import EngineConfig
from areno.engine.kv.block_manager import BlockManager
from areno.engine.kv.prefix_cache import PrefixCache
from areno.engine.sampling import SamplingParams
from areno.engine.sequence import SequenceGroup
from areno.errors import ConfigError
from areno.processing.types import MediaSpan, PromptInputs
from areno.serve.app import _generator_routing
from areno.serve.config import ServeConfig
from areno.serve.prefix_index import MAX_ROUTED_BLOCKS, PrefixIndex, choose, prompt_hashes

BLOCK = 4


def test_a_replica_matches_the_leading_blocks_it_was_sent() -> None:
    index = PrefixIndex()
    index.insert("a", [b"1", b"2", b"3"])
    index.insert("b", [b"1", b"9"])
    assert index.matches([b"1", b"2", b"3", b"4"], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    index.keep_only(["b"])  # "a" is gone (a replacement replica starts empty)
    assert index.matches([b"1", b"2"], ["a", "b"]) == {"a": 0, "b": 1}


def test_the_index_forgets_the_least_recently_sent_blocks_first() -> None:
    index = PrefixIndex(capacity=3)
    index.insert("a", [b"1", b"2"])
    index.insert("a", [b"3"])
    index.insert("a", [b"1"])  # sent again: now the newest
    index.insert("a", [b"4"])  # over capacity: b"2" goes
    assert index.matches([b"1", b"2"], ["a"]) == {"a": 1}
    assert index.matches([b"3"], ["a"]) == {"a": 1}


def test_the_longest_prefix_wins_unless_its_replica_is_too_busy_for_what_it_saves() -> None:
    rng = random.Random(0)
    matches = {"a": 5, "b": 0, "c": 0}  # the whole prompt's 5 blocks on "a"
    assert choose(matches, {"a": 4, "b": 0, "c": 0}, 5, max_imbalance=4, rng=rng) == "a"
    # Five requests more than the least busy: a less busy one of two random replicas instead.
    picks = {choose(matches, {"a": 5, "b": 0, "c": 0}, 5, 4, rng) for _ in range(50)}
    assert picks == {"b", "c"}
    # A match that saves a fifth of the prompt (a shared system prompt) buys a fifth of the
    # imbalance: one request more is too many here, none is not.
    assert choose({"a": 2, "b": 0}, {"a": 1, "b": 0}, 10, 4, rng) == "b"
    assert choose({"a": 2, "b": 0}, {"a": 0, "b": 0}, 10, 4, rng) == "a"
    # What the least busy replica holds too saves nothing over it.
    assert choose({"a": 6, "b": 5}, {"a": 1, "b": 0}, 10, 4, rng) == "b"
    # Two holders of the longest prefix: the less busy one.
    assert choose({"a": 5, "b": 5}, {"a": 2, "b": 1}, 5, 4, rng) == "b"


def test_a_prompt_that_matches_nothing_goes_to_the_less_busy_replica() -> None:
    rng = random.Random(0)
    picks = [choose({"a": 0, "b": 0}, {"a": 3, "b": 1}, 5, 4, rng) for _ in range(20)]
    assert set(picks) == {"b"}
    # Equally busy and nothing matched: either.
    picks = {choose({"a": 0, "b": 0}, {"a": 0, "b": 0}, 5, 4, rng) for _ in range(50)}
    assert picks == {"a", "b"}


def _inputs(token_ids: list[int], spans: list[MediaSpan] = ()) -> PromptInputs:
    return PromptInputs(token_ids, {}, list(spans))


def _engine_hashes(inputs: PromptInputs, params: SamplingParams) -> list[bytes]:
    """The prefix hashes the engine registers the prompt's full blocks under."""
    group = SequenceGroup.create("r", inputs.input_ids, params, inputs)
    cache = PrefixCache(True, BlockManager(64, BLOCK), 0, {"r": group})
    return cache.hashes(group.seqs[0], len(inputs.input_ids) // BLOCK)


def test_the_router_keys_a_prompt_by_the_engines_own_block_hashes() -> None:
    image = MediaSpan("image", 0, 5, 9, 4, content_hash="cafe")
    other = MediaSpan("image", 0, 5, 9, 4, content_hash="beef")
    tokens = list(range(100, 114))  # three full blocks and two tokens
    for inputs, params in [
        (_inputs(tokens), SamplingParams()),
        (_inputs(tokens, [image]), SamplingParams()),
        (_inputs(tokens), SamplingParams(adapter="tiny-lora")),
    ]:
        hashes = prompt_hashes("generate", [inputs, params, "id", None], BLOCK)
        assert len(hashes) == 3
        assert hashes == _engine_hashes(inputs, params)
    # Another image behind the same placeholders, or an adapter, keys the blocks apart.
    plain = prompt_hashes("generate_all", [_inputs(tokens), SamplingParams()], BLOCK)
    with_other = prompt_hashes("generate_all", [_inputs(tokens, [other]), SamplingParams()], BLOCK)
    assert plain[0] == with_other[0] and plain[1] != with_other[1]
    # Calls without a prompt to prefill are routed by load alone.
    assert prompt_hashes("stats", [], BLOCK) == []
    assert prompt_hashes("score", [_inputs(tokens), None, 0], BLOCK) == []
    # A long prompt is keyed by its first MAX_ROUTED_BLOCKS blocks.
    long = prompt_hashes("generate", [_inputs(list(range(BLOCK * 300))), None], BLOCK)
    assert len(long) == MAX_ROUTED_BLOCKS


def test_routing_is_a_setting_that_names_its_router_or_is_refused() -> None:
    assert ServeConfig(model_path="m").routing == "power_of_two"  # Serve's own, the default
    config = ServeConfig(model_path="m", world_size=2, routing="prefix")
    assert config.max_imbalance == 8
    router = _generator_routing(config)["request_router_config"]
    assert router.request_router_class == "areno.serve.routing:PrefixRouter"
    assert router.request_router_kwargs == {"block_size": 16, "max_imbalance": 8}
    config = ServeConfig(
        model_path="m",
        routing="prefix",
        routing_max_imbalance=2,
        engine=EngineConfig(block_size=32),
    )
    kwargs = _generator_routing(config)["request_router_config"].request_router_kwargs
    assert kwargs == {"block_size": 32, "max_imbalance": 2}
    rr = _generator_routing(ServeConfig(model_path="m", routing="round_robin"))
    assert rr["request_router_config"].request_router_class.endswith(":RoundRobinRouter")
    assert _generator_routing(ServeConfig(model_path="m", routing="power_of_two")) == {}
    with pytest.raises(ConfigError, match="--routing must be one of prefix, round_robin"):
        ServeConfig(model_path="m", routing="random")
    with pytest.raises(ConfigError, match="--routing-max-imbalance must be an integer >= 0"):
        ServeConfig(model_path="m", routing_max_imbalance=-1)


def test_serve_flags_set_the_routing() -> None:
    from areno.cli import build_parser

    args = build_parser().parse_args(["serve", "--routing", "round_robin"])
    assert (args.routing, args.routing_max_imbalance) == ("round_robin", None)
    args = build_parser().parse_args(["serve", "--routing-max-imbalance", "3"])
    assert (args.routing, args.routing_max_imbalance) == ("power_of_two", 3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--routing", "random"])
