"""`--tp-size 2` end to end: the Generator as rank 0 with a Ray actor as rank 1 (gloo on CPU)
gives the same tokens as `--tp-size 1`, and takes weight updates into its shards."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import ray
import torch

from areno.engine.config import EngineConfig
from areno.engine.generator import EngineDeadError, Generator
from areno.engine.parallel import kv_pool
from areno.engine.sampling import SamplingParams
from areno.errors import ConfigError
from areno.media import MediaDecoder, MediaPolicy
from areno.media.samples import write_audio, write_image
from areno.models.tiny import build_tiny
from areno.processing import Processor, process_messages
from tests.engine.generating import arrive_together

PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=True)


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def config(tp_size: int) -> EngineConfig:
    return EngineConfig(
        tp_size=tp_size, max_running_prompts=4, max_context_len=1024, num_cpus_per_rank=0.5
    )


def encode_requests(path, tmp_path):
    processor = Processor(path)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    image = str(write_image(tmp_path / "a.png", 64, 48))
    requests = [
        [{"role": "user", "content": "Hello there, how are you doing today?"}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": "Describe."},
                ],
            }
        ],
    ]
    if "audio" in processor.adapter.modalities:
        audio = str(write_audio(tmp_path / "a.wav", seconds=1.0))
        part = {"type": "audio_url", "audio_url": {"url": audio}}
        requests.append([{"role": "user", "content": [part]}])
    return [process_messages(processor, decoder, r) for r in requests]


async def run_all(gen: Generator, inputs) -> list:
    return await asyncio.gather(*(gen.generate_all(x, PARAMS) for x in inputs))


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4", "minicpmv4_6"])
def test_tp2_gives_the_same_tokens_as_tp1(tiny_path, tmp_path, family):
    path = tiny_path(family)
    inputs = encode_requests(path, tmp_path)
    single = Generator.from_config(path, config(1))
    try:
        want = asyncio.run(run_all(single, inputs))
    finally:
        single.shutdown()
    split = Generator.from_config(path, config(2))
    try:
        have = asyncio.run(run_all(split, inputs))
    finally:
        split.shutdown()
    for w, h in zip(want, have, strict=True):
        assert h.samples[0].token_ids == w.samples[0].token_ids
        assert torch.allclose(
            torch.tensor(h.samples[0].logprobs), torch.tensor(w.samples[0].logprobs), atol=1e-4
        )


def test_tp2_over_a_pool_that_preempts_gives_tp1s_tokens(tiny_path, tmp_path):
    """Blocks of 4 tokens, as many as the prompts of the four running requests take and one
    more: decodes preempt, on both sides; each rank pages its own heads (half the bytes a
    block on each of two ranks, the same block count)."""
    path = tiny_path("qwen3_5")
    inputs = encode_requests(path, tmp_path)
    processor = Processor(path)
    decoder = MediaDecoder(MediaPolicy.for_training(), processor.decode_options())
    for words in ("Count to ten.", "Name three rivers of Europe, please."):
        inputs.append(process_messages(processor, decoder, [{"role": "user", "content": words}]))
    num_blocks = sum(-(-x.num_prompt_tokens // 4) for x in inputs) + 1
    longest = max(x.num_prompt_tokens for x in inputs) + PARAMS.max_tokens + 1

    # the pool of one rank's heads: all of them at tp_size 1, half at 2
    gib = kv_pool.pool_gib(processor.adapter.load_model(path), num_blocks, block_size=4)
    results = {}
    for tp_size in (1, 2):
        engine = EngineConfig(
            tp_size=tp_size,
            max_running_prompts=4,
            max_context_len=longest,
            block_size=4,
            kv_cache_gib=gib / tp_size,
            num_cpus_per_rank=0.5,
        )
        gen = Generator.from_config(path, engine)
        try:
            assert gen.stats()["num_blocks"] == num_blocks
            outputs = asyncio.run(arrive_together(gen, inputs, PARAMS))
            results[tp_size] = (outputs, gen.stats()["num_preemptions"])
        finally:
            gen.shutdown()
    (want, preempted_1), (have, preempted_2) = results[1], results[2]
    assert preempted_1 > 0 and preempted_2 > 0
    for w, h in zip(want, have, strict=True):
        assert h.samples[0].token_ids == w.samples[0].token_ids


def test_tp2_update_weights_reaches_every_shard(tiny_path, tmp_path):
    path = tiny_path("qwen3_5")
    other = build_tiny("qwen3_5", tmp_path / "seed1", seed=1)
    inputs = encode_requests(path, tmp_path)
    reference = Generator.from_config(other, config(1))
    try:
        want = asyncio.run(run_all(reference, inputs))
        weights = dict(reference.core.executor.model.named_parameters())
        weights = {name: p.detach().clone() for name, p in weights.items()}
    finally:
        reference.shutdown()
    split = Generator.from_config(path, config(2))
    try:
        before = asyncio.run(run_all(split, inputs))
        asyncio.run(split.update_weights(ray.put(weights), version=3))
        after = asyncio.run(run_all(split, inputs))
    finally:
        split.shutdown()
    assert [o.samples[0].token_ids for o in after] == [o.samples[0].token_ids for o in want]
    assert [o.samples[0].token_ids for o in before] != [o.samples[0].token_ids for o in want]
    assert {o.policy_version for o in after} == {3}


def test_tp_is_refused_for_a_family_without_a_plan(tiny_path):
    with pytest.raises(ConfigError, match="tensor-parallel plan"):
        Generator.from_config(tiny_path("qwen3_vl"), config(2))
    # refused before any rank joined a group: none is left to hang a later collective
    assert not torch.distributed.is_initialized()


def test_a_lost_follower_fails_the_requests_instead_of_hanging_the_group(tiny_path, tmp_path):
    from areno.engine.parallel.tp_executor import FOLLOWER_CHECK_S

    path = tiny_path("qwen3_5")
    inputs = encode_requests(path, tmp_path)[:1]
    split = Generator.from_config(path, config(2))
    try:
        asyncio.run(run_all(split, inputs))  # the group works
        ray.kill(split.core.executor.followers[0])
        time.sleep(FOLLOWER_CHECK_S + 0.5)
        with pytest.raises(EngineDeadError, match="follower stopped following"):
            asyncio.run(asyncio.wait_for(run_all(split, inputs), timeout=60))
    finally:
        split.shutdown()  # without a collective: the follower is gone
    assert not torch.distributed.is_initialized()
