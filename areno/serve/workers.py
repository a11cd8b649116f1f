"""The three worker deployments: MediaDecoder, Processor and Generator as Ray Serve replicas.

Each wraps the very class that training runs as a Ray actor (`MediaDecoder`, `Processor`,
`Generator`), adding what serving needs around it: the server's media policy, Serve's health
check, the Generator replica's admission queue (429 / 503) and Prometheus metrics.

A request with media runs through them as a chain: the Processor takes the MediaDecoder's reply
straight from Ray (the Ingress hands it on unread), and answers a `StoredPrompt`, whose media
tensors only the Generator replica reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple

import ray
from ray import serve

from areno.engine.sampling import SamplingParams
from areno.errors import ArenoError
from areno.media import MediaDecoder, MediaPolicy
from areno.processing import Processor
from areno.processing.encode import PromptLimits
from areno.processing.types import PromptInputs
from areno.processing.warmup import warm_up_prompts
from areno.serve.admission import Admission, EngineUnavailableError
from areno.serve.config import ServeConfig
from areno.serve.errors import Refused, aborted_error

# A child of "ray.serve": Serve routes it to the replica's log file and the driver's console.
logger = logging.getLogger("ray.serve.areno")
# How often a Generator replica reports its engine's gauges and counters (off the requests' path:
# each report is several Ray metric calls).
REPORT_PERIOD_S = 0.5


@serve.deployment(max_ongoing_requests=64)
class MediaDecoderServer:
    """Resolves and decodes media parts under the server's media policy, where it runs."""

    def __init__(self, config: ServeConfig):
        processor = Processor(config.model_path)  # for the family's decode options only
        policy = MediaPolicy.for_server(
            config.host,
            config.allowed_local_media_paths,
            allow_remote=config.allow_remote_media,
            allow_private_network=config.allow_private_network_media,
        )
        self.decoder = MediaDecoder(policy, processor.decode_options())
        from ray.serve import metrics

        self.decode_seconds = metrics.Histogram(
            "areno_media_decode_s",
            "Seconds to resolve and decode one media item.",
            boundaries=[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5],
            tag_keys=("modality",),
        )

    def decode_many(self, refs: list) -> MediaBatch | Refused:
        """The decoded items, or Refused with the first item's error (a missing file, an
        undecodable codec, a refused URL: see `Refused`)."""
        began = time.perf_counter()
        decoded = []
        for ref in refs:
            start = time.perf_counter()
            try:
                decoded.append(self.decoder.decode(ref))
            except ArenoError as error:
                return Refused(error)
            self.decode_seconds.observe(
                time.perf_counter() - start, tags={"modality": ref.modality}
            )
        return MediaBatch(decoded, time.perf_counter() - began)


class MediaBatch(NamedTuple):
    """A request's decoded media items, and the seconds their decoding took (Server-Timing)."""

    items: list
    decode_s: float


class StoredPrompt(NamedTuple):
    """A request's encoded prompt with media, as the Processor replica answers it: `inputs`
    without the media tensors (token ids, spans, prompt text: what the Ingress reads) and `ref`,
    the whole PromptInputs in Ray's object store, which the Ingress passes to the Generator
    replica unread; the seconds its media's decoding and its encoding took (Server-Timing)."""

    inputs: PromptInputs
    ref: ray.ObjectRef
    decode_s: float = 0.0
    process_s: float = 0.0


@serve.deployment(max_ongoing_requests=64)
class ProcessorServer:
    """Chat template + native processor: messages and decoded media to a StoredPrompt (requests
    with media; the Ingress encodes text-only requests itself)."""

    def __init__(self, config: ServeConfig):
        limits = PromptLimits(config.max_prompt_tokens, config.engine.max_context_len)
        self.processor = Processor(config.model_path, limits=limits)
        warm_up_prompts(self.processor)  # the native processor's first call, per modality

    def encode(
        self,
        messages: list,
        media: MediaBatch | Refused,
        tools: list | None,
        template_kwargs: Any,
        max_new_tokens: int | None = None,
    ) -> StoredPrompt | Refused:
        """The StoredPrompt, or Refused: the MediaDecoder's refusal of `media`, passed on, or
        this replica's own (a prompt over the limits, media the processor cannot take)."""
        if isinstance(media, Refused):
            return media
        start = time.perf_counter()
        try:
            inputs = self.processor.encode(
                messages,
                media.items,
                tools=tools,
                chat_template_kwargs=template_kwargs,
                max_new_tokens=max_new_tokens,
            )
        except ArenoError as error:
            return Refused(error)
        header = PromptInputs(inputs.input_ids, {}, inputs.mm_spans, inputs.prompt_text)
        stored = ray.put(inputs)
        return StoredPrompt(header, stored, media.decode_s, time.perf_counter() - start)


@serve.deployment(max_ongoing_requests=4096)
class GeneratorServer:
    """One replica is one engine: a tensor-parallel group when tp_size > 1 (this replica is
    rank 0, in the first bundle of its STRICT_PACK placement group)."""

    def __init__(self, config: ServeConfig):
        # Encoded before the engine starts: its thread must stay this process's only OpenMP user
        # (areno/engine/openmp.py), and the processor runs torch ops.
        start = time.perf_counter()
        limits = PromptLimits(config.max_prompt_tokens, config.engine.max_context_len)
        start_up_prompts = warm_up_prompts(Processor(config.model_path, limits=limits))
        processor_s = time.perf_counter() - start
        start = time.perf_counter()
        # Imported here: the engine (torch's compiler, the model code) costs seconds of a
        # replica's start, and the other deployments of this module never use it.
        from areno.engine.generator import Generator

        imports_s = time.perf_counter() - start
        self.generator = Generator.from_config(config.model_path, config.engine)
        # The replica's own phases lead the engine's in its start-up line (and the banner).
        self.generator.start_up = {
            "processor": processor_s,
            "imports": imports_s,
            **self.generator.start_up,
        }
        self.generator.add_adapters(config.lora_adapters)  # --lora
        # Each media tower's first forward, here rather than in a user's first request of it.
        self.generator.warm_up(start_up_prompts)
        logger.info("start-up: %s", self.generator.describe_start_up())
        self.admission = Admission(config.engine.max_running_prompts, config.queue_limit)
        from ray.serve import metrics

        self.queue_depth = metrics.Gauge(
            "areno_engine_waiting", "Sequences waiting for a slot and KV blocks in this engine."
        )
        self.running = metrics.Gauge("areno_engine_running", "Sequences decoding in this engine.")
        self.free_blocks = metrics.Gauge(
            "areno_engine_free_kv_blocks", "KV cache blocks free in this engine's pool."
        )
        # Engine counters (stats key -> Serve counter), raised by what they grew since read.
        self.counters = {
            "num_preemptions": metrics.Counter(
                "areno_engine_preemptions",
                "Sequences preempted for KV blocks (recomputed later) in this engine.",
            ),
            "num_prompt_tokens_admitted": metrics.Counter(
                "areno_engine_prompt_tokens",
                "Prompt tokens of the sequences this engine admitted (prefill requested).",
            ),
            "num_prompt_tokens_cached": metrics.Counter(
                "areno_engine_prompt_tokens_cached",
                "Of those, the tokens the prefix cache held (not prefilled again).",
            ),
            "num_state_hits": metrics.Counter(
                "areno_engine_prefix_state_hits",
                "Prompts resumed from a saved linear-attention or sliding-window state.",
            ),
            "num_state_saves": metrics.Counter(
                "areno_engine_prefix_state_saves",
                "Linear-attention or sliding-window states saved for prompts to resume from.",
            ),
            "num_state_evictions": metrics.Counter(
                "areno_engine_prefix_state_evictions",
                "Saved states evicted, least recently used, for a new one.",
            ),
        }
        self._counted = dict.fromkeys(self.counters, 0)
        self._reporter: asyncio.Task | None = None
        logger.info("%s", self.generator.pool.describe(self.generator.max_context_len))

    def start_up(self) -> str:
        """The engine's start-up phases with their seconds (Generator.describe_start_up)."""
        return self.generator.describe_start_up()

    # NOTE: the three request methods answer a user-facing error (ArenoError: a full queue, a
    # paused engine, a prompt the engine refuses, a request it cut off) as a Refused value, not
    # an exception (areno/serve/errors.py, `Refused`); the Ingress unwraps it. So do the
    # decoder's and the processor's.
    # `stored`: a request with media's whole prompt, which Ray fetched here from the reference
    # of its StoredPrompt; `inputs` then holds its token ids as the Ingress prepared them.

    async def generate_all(
        self,
        inputs: PromptInputs,
        params: SamplingParams,
        request_id: str,
        stored: PromptInputs | None = None,
    ):
        """The whole request in one reply (non-streaming HTTP: no per-delta handle traffic), or
        Refused; RequestAbortedError (503) for a request the engine cut off."""
        inputs = with_media(inputs, stored)
        try:
            self._admit(params, request_id)
        except ArenoError as error:
            return Refused(error)
        try:
            output = await self.generator.generate_all(inputs, params, request_id)
        except ArenoError as error:
            return Refused(error)
        finally:
            self._release(request_id)
        if (error := aborted_error(output)) is not None:
            return Refused(error)
        return output

    async def generate(
        self,
        inputs: PromptInputs,
        params: SamplingParams,
        request_id: str,
        stored: PromptInputs | None = None,
    ):
        """The request's deltas; a refused request yields only its Refused, and one the engine
        cuts off ends with Refused(RequestAbortedError) (the Ingress's error event) in place of
        its aborted delta."""
        inputs = with_media(inputs, stored)
        try:
            self._admit(params, request_id)
        except ArenoError as error:
            yield Refused(error)
            return
        try:
            async for output in self.generator.generate(inputs, params, request_id):
                if (error := aborted_error(output)) is not None:
                    yield Refused(error)
                    return
                yield output
        except ArenoError as error:
            yield Refused(error)
        finally:
            self._release(request_id)

    async def score(self, inputs, adapter: str | None, num_top_logprobs: int):
        """`Generator.score`: one forward, outside the batch and its slots (no admission), so
        only a paused engine refuses it (Refused, as the others)."""
        if self.generator.is_paused:
            return Refused(EngineUnavailableError("the generation engine is paused; retry shortly"))
        try:
            return await self.generator.score(inputs, adapter, num_top_logprobs=num_top_logprobs)
        except ArenoError as error:
            return Refused(error)

    async def pause(self, mode: str = "drain") -> None:
        """Pause the engine (`Generator.pause`: keep / drain / abort); requests arriving
        meanwhile get 503. For an operator or a weight update."""
        await self.generator.pause(mode)

    async def resume(self) -> None:
        await self.generator.resume()

    def _admit(self, params: SamplingParams, request_id: str) -> None:
        """Refuse at once what would otherwise hang: 503 while the engine is paused (an RL
        weight update), 429 when the waiting queue is full. A dead engine raises
        EngineDeadError from `generate` itself (503 too)."""
        if self.generator.is_paused:
            raise EngineUnavailableError("the generation engine is paused; retry shortly")
        self.admission.admit(request_id, params.n)
        if self._reporter is None:  # started on the replica's event loop, with its first request
            self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    def _release(self, request_id: str) -> None:
        self.admission.release(request_id)

    async def _report_forever(self) -> None:
        while True:
            self._report()
            await asyncio.sleep(REPORT_PERIOD_S)

    def _report(self) -> None:
        stats = self.generator.stats()
        self.queue_depth.set(stats["num_waiting"])
        self.running.set(stats["num_running"])
        self.free_blocks.set(stats["num_free_blocks"])
        for key, counter in self.counters.items():
            if stats[key] > self._counted[key]:
                counter.inc(stats[key] - self._counted[key])
                self._counted[key] = stats[key]

    def stats(self) -> dict[str, int]:
        return self.generator.stats()

    def replica_stats(self) -> tuple[str, dict[str, int]]:
        """This replica's Serve id and its engine's stats: `handle.broadcast("replica_stats")`
        tells every replica's prefix-cache counters apart (where routing sent the prompts)."""
        return serve.get_replica_context().replica_id.unique_id, self.generator.stats()

    def check_health(self) -> None:
        """Serve's periodic replica check: an engine that cannot step (a lost tensor-parallel
        follower) fails it, and Serve replaces this replica, its placement group and followers."""
        self.generator.check_health()

    def __del__(self) -> None:
        generator = getattr(self, "generator", None)
        if generator is not None:
            generator.shutdown()


def with_media(inputs: PromptInputs, stored: PromptInputs | None) -> PromptInputs:
    """The prompt the engine runs: `inputs` itself for a text request; for one with media, its
    `stored` whole prompt with the token ids of `inputs` (which may end with a forced call
    opening: with_tokens extends the per-token media tensors to match)."""
    if stored is None:
        return inputs
    if inputs.input_ids == stored.input_ids:
        return stored
    return stored.with_tokens(inputs.input_ids)
