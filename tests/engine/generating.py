"""What the Generator tests share: the families, a family's processor / decoder / model with a
Generator factory and transformers' greedy reference, and the requests they send."""

from __future__ import annotations

import asyncio

import torch

from areno.engine.config import EngineConfig
from areno.engine.generator import Generator
from areno.engine.sampling import SamplingParams
from areno.media import MediaDecoder, MediaPolicy
from areno.processing import Processor, process_messages

FAMILIES = ["qwen3_5", "qwen3_vl", "minicpmv4_6", "gemma4"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def text(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def with_media(kind: str, url: str, prompt: str) -> list[dict]:
    part = {"type": f"{kind}_url", f"{kind}_url": {"url": url}}
    return [{"role": "user", "content": [part, {"type": "text", "text": prompt}]}]


class Setup:
    """A family's processor, decoder and model, plus a Generator factory."""

    def __init__(self, path):
        self.processor = Processor(path)
        self.decoder = MediaDecoder(MediaPolicy.for_training(), self.processor.decode_options())
        self.model = self.processor.adapter.load_model(path).eval()

    def encode(self, messages):
        return process_messages(self.processor, self.decoder, messages)

    def generator(self, **config) -> Generator:
        config = {"max_running_prompts": 4, "max_context_len": 1024} | config
        if config.get("prefill_compile", "off") != "off":
            # Every engine of the process compiles the same text-stack code, and dynamo keeps
            # a limited number of compiles per code: earlier tests' would crowd out this one's.
            torch._dynamo.reset()
        return Generator.from_model(self.model, self.processor.tokenizer, EngineConfig(**config))

    def reference(self, inputs, max_new_tokens: int) -> list[int]:
        """transformers' greedy generate, cut after the first EOS as the engine stops there."""
        model_inputs = {k: v.to(self.model.device) for k, v in inputs.model_inputs().items()}
        out = self.model.generate(**model_inputs, max_new_tokens=max_new_tokens, do_sample=False)
        tokens = out[0, inputs.num_prompt_tokens :].tolist()
        eos = set(self.model.generation_config.eos_token_id)
        for i, token in enumerate(tokens):
            if token in eos:
                return tokens[: i + 1]
        return tokens


def frames_compiled() -> int:
    """The frames torch.compile has compiled in this process so far (dynamo's count), and the
    graphs traced to be saved in the compile cache (areno/engine/runner/saved_traces.py)."""
    from torch._dynamo.utils import counters

    from areno.engine import compile_cache

    return counters["frames"]["ok"] + compile_cache.traces["traced"]


def run(coro):
    return asyncio.run(coro)


async def arrive_together(gen: Generator, inputs, params) -> list:
    """Every request queued while the engine holds, then started in one step; their outputs."""
    await gen.pause("keep")
    tasks = [asyncio.create_task(gen.generate_all(x, params)) for x in inputs]
    while gen.stats()["num_waiting"] < len(inputs):
        await asyncio.sleep(0.005)
    await gen.resume()
    return await asyncio.gather(*tasks)


async def collect(stream) -> tuple[list[int], str, list]:
    tokens, out_text, deltas = [], "", []
    async for output in stream:
        for delta in output.samples:
            tokens += delta.token_ids
            out_text += delta.text
            deltas.append(delta)
    return tokens, out_text, deltas


def mixed_requests(setup: Setup, media) -> list:
    requests = [
        text("Hello there, how are you doing today my friend?"),
        with_media("image", media["image"], "Describe."),
        text("Short."),
        with_media("video", media["video"], "What happens?"),
    ]
    if "audio" in setup.processor.adapter.modalities:
        requests.append(with_media("audio", media["audio"], "Listen."))
    return [setup.encode(m) for m in requests]


def run_chunked(gen, inputs: list) -> tuple[list, list[tuple[int, int, int]]]:
    """inputs[0] decoding, then the rest arriving; returns their outputs and every prefill
    chunk the runner ran, alone or in a forward of parts, as (prompt tokens, start, end)."""
    chunks: list[tuple[int, int, int]] = []
    runner = gen.core.executor.runner
    prefill_chunk, prefill_parts = runner.prefill_chunk, runner.prefill_parts

    def recording(inputs, slot, table, start, end, cached=0):
        chunks.append((inputs.num_prompt_tokens, start, end))
        return prefill_chunk(inputs, slot, table, start, end, cached)

    def recording_parts(parts):
        chunks.extend((p.inputs.num_prompt_tokens, p.start, p.end) for p in parts)
        return prefill_parts(parts)

    runner.prefill_chunk, runner.prefill_parts = recording, recording_parts

    async def main():
        first = asyncio.create_task(gen.generate_all(inputs[0], GREEDY))
        while gen.stats()["num_running"] == 0:
            await asyncio.sleep(0.001)
        rest = [asyncio.create_task(gen.generate_all(x, GREEDY)) for x in inputs[1:]]
        return await asyncio.gather(first, *rest)

    try:
        return run(main()), chunks
    finally:
        gen.shutdown()
