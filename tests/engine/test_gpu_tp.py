"""`--tp-size 2` over NCCL on two GPUs (run on a GPU machine; skipped elsewhere): the same
greedy tokens and logprobs as `--tp-size 1`, in fp32 so that the reduction order cannot flip a
token."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.sampling import SamplingParams
from areno.processing.types import PromptInputs

ray = pytest.importorskip("ray")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("graphs", ["off", "capture"])  # eager first: it isolates NCCL itself
@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_tp2_over_nccl_gives_the_same_tokens_as_tp1(tiny_path, family, graphs):
    torch.manual_seed(0)
    prompts = [torch.randint(5, 500, (n,)).tolist() for n in (7, 64, 200)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)
    outputs = {}
    for tp_size in (1, 2):
        config = EngineConfig(
            tp_size=tp_size,
            max_running_prompts=4,
            max_context_len=512,
            dtype="float32",
            decode_graphs=graphs,
            decode_compile="off",  # NCCL is under test here, not the compiler (test_gpu.py)
        )
        gen = Generator.from_config(tiny_path(family), config)

        async def run_all(gen=gen):
            return await asyncio.gather(
                *(gen.generate_all(PromptInputs(p, {}), params) for p in prompts)
            )

        try:
            assert gen.core.executor.worker.device.type == "cuda"
            outputs[tp_size] = asyncio.run(run_all())
        finally:
            gen.shutdown()
    for one, two in zip(outputs[1], outputs[2], strict=True):
        assert two.samples[0].token_ids == one.samples[0].token_ids
        assert torch.allclose(
            torch.tensor(two.samples[0].logprobs), torch.tensor(one.samples[0].logprobs), atol=1e-3
        )
