"""`--tp-size 2` over NCCL on two GPUs (run on a GPU machine; skipped elsewhere): the same
greedy tokens and logprobs as `--tp-size 1`, in fp32 so that the reduction order cannot flip a
token.

Each engine runs in a Ray actor of its own holding one GPU, as in a Serve replica: rank 0 is a
fresh process that sees only its GPU, and every TP group is its process's first (see
`parallel.can_bind_device` for what a second group in one process meets on torch 2.11).
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import ray
import torch

from areno.engine.config import EngineConfig
from areno.engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


RUN_TIMEOUT_S = 150  # one tiny engine: start, 3 requests, shut down (a hang fails the test)


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    # EngineRun travels by value: the actors need not import this test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


class EngineRun:
    """One engine in this actor's process: greedy outputs for the prompts, then shut down."""

    def run(self, path: str, config: EngineConfig, prompts: list[list[int]]) -> tuple[str, list]:
        import faulthandler

        from areno.engine.generator import Generator
        from areno.processing.types import PromptInputs

        # A hang writes this actor's stacks to its Ray worker log before the test gives up on it.
        faulthandler.dump_traceback_later(RUN_TIMEOUT_S - 10)

        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)
        gen = Generator.from_config(path, config)

        async def run_all():
            return await asyncio.gather(
                *(gen.generate_all(PromptInputs(p, {}), params) for p in prompts)
            )

        try:
            outputs = asyncio.run(run_all())
        finally:
            gen.shutdown()
            faulthandler.cancel_dump_traceback_later()
        samples = [(out.samples[0].token_ids, out.samples[0].logprobs) for out in outputs]
        return gen.core.executor.device.type, samples


@pytest.mark.parametrize("graphs", ["off", "capture"])  # eager first: it isolates NCCL itself
@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_tp2_over_nccl_gives_the_same_tokens_as_tp1(tiny_path, family, graphs):
    torch.manual_seed(0)
    prompts = [torch.randint(5, 500, (n,)).tolist() for n in (7, 64, 200)]
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
        actor = ray.remote(num_gpus=1, num_cpus=1)(EngineRun).remote()
        try:
            device, outputs[tp_size] = ray.get(
                actor.run.remote(str(tiny_path(family)), config, prompts), timeout=RUN_TIMEOUT_S
            )
        finally:
            ray.kill(actor)
        assert device == "cuda"
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(outputs[1], outputs[2], strict=True):
        assert tokens2 == tokens1
        assert torch.allclose(torch.tensor(logprobs2), torch.tensor(logprobs1), atol=1e-3)
