"""The Generator: the engine's async API and RL hooks, around one engine thread.

All engine state is touched by one thread only. `generate`, `score`, `update_weights`, `pause`
and `resume` are coroutines that hand commands to that thread and await the results, so the
engine steps continuously while callers on the event loop stream their deltas. The same class
serves HTTP (a Ray Serve replica) and RL rollouts (a Ray actor).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from areno.engine import compile_cache, gc_freeze
from areno.engine.config import (
    EngineConfig,
    resolve_device,
    resolve_dtype,
    resolve_max_context_len,
    resolve_overlap,
)
from areno.engine.core import startup
from areno.engine.core.engine_core import EngineCore
from areno.engine.core.scheduler import DuplicateRequestError, SchedulerConfig
from areno.engine.layers.lora import POLICY_ADAPTER, LoraWeights
from areno.engine.openmp import release_thread_pool
from areno.engine.outputs import (
    AbortCause,
    EngineDeadError,
    RequestOutput,
    TokenScores,
    merge_outputs,
)
from areno.engine.parallel.executor import Executor, LocalExecutor
from areno.engine.parallel.ipc import CudaIpcWeights
from areno.engine.parallel.tensor_parallel import load_model_for_rank
from areno.engine.parallel.worker import Worker
from areno.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams
from areno.errors import ConfigError
from areno.models.registry import adapter_for_checkpoint
from areno.processing.types import PromptInputs

PAUSE_MODES = ("keep", "drain", "abort")
# How long `shutdown` waits for the engine thread to end the requests in flight.
SHUTDOWN_ABORT_S = 10.0

log = logging.getLogger(__name__)


class StartupRunError(RuntimeError):
    """A start-up prompt (`Generator.warm_up`) failed: the engine cannot serve that input kind."""


class Generator:
    """Continuous-batching generation over one model replica (see the module docstring)."""

    def __init__(
        self,
        executor: Executor,
        tokenizer: Any,
        config: EngineConfig,
        *,
        max_context_len: int,
        eos_token_ids: Collection[int],
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.max_context_len = max_context_len
        pool = executor.pool
        try:
            scheduler_config = SchedulerConfig(
                max_running_prompts=config.max_running_prompts,
                max_context_len=max_context_len,
                max_num_batched_tokens=config.max_num_batched_tokens,
                num_blocks=pool.num_blocks,
                block_size=pool.block_size,
                enable_prefix_caching=(config.enable_prefix_caching and executor.caches_prefixes),
                num_state_rows=executor.num_state_rows,
                # NOTE: not where whole prompts prefill compiled and parts of prompts do not: a
                # save splits the prefill into parts, which eagerly cost the host what the
                # compiled whole prompt saves (57 ms of host time for a 256-token prompt of
                # the 1.7B shape on an H100, docs/performance.md); there text prompts would
                # resume only from what their turns and groups saved.
                saves_text_prompts=(
                    not (paths := executor.compiled_paths()).batched_prefill or paths.prefill_parts
                ),
                checkpoint_blocks=config.prefix_checkpoint_blocks,
            )
        except BaseException:
            executor.shutdown()
            raise
        log.info("%s", pool.describe(max_context_len))
        self.core = EngineCore(
            executor,
            tokenizer,
            scheduler_config,
            eos_token_ids,
            overlap=resolve_overlap(config, executor.device.type),
        )
        # request id -> (its caller's loop, its queue, whether it wants only the final output)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, bool]] = {}
        # The outputs not yet handed over of final-only requests, and of streamed ones within
        # their stream interval, and when each streamed one's were last handed over (the engine
        # thread's; shutdown clears them after).
        self._collected: dict[str, list[RequestOutput]] = {}
        self._held: dict[str, list[RequestOutput]] = {}
        self._handed_at: dict[str, float] = {}
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future | None]] = []
        self._wake = threading.Condition()
        self._paused = False
        self._stopped = False
        self._idle_waiters: list[concurrent.futures.Future] = []
        # Seconds per start-up phase, in order (from_config adds "load" before, warm_up after).
        self.start_up: dict[str, float] = {}
        # The start-up compile's seconds by forward (startup.run_steps).
        self.start_up_compiles: dict[str, float] = {}
        self.compile_cache: Path | None = None
        self.compile_cache_files = 0
        try:
            startup.run_steps(self.core, self.start_up, self.start_up_compiles)
        except BaseException:
            executor.shutdown()  # a tensor-parallel group's follower actors too
            raise
        gc_freeze.hold()  # what lives now stays out of collections (gc_freeze.py)
        self._holds_gc_freeze = True
        if executor.device.type == "cpu":
            # The engine thread must own the process's only OpenMP pool (areno/engine/openmp.py).
            release_thread_pool()
        self._thread = threading.Thread(target=self._run, name="areno-engine", daemon=True)
        self._thread.start()

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        tokenizer: Any,
        config: EngineConfig,
        *,
        eos_token_ids: Collection[int] = (),
    ) -> Generator:
        """A single-process Generator over an already loaded model (tests, benchmarks); its
        compiles use AReno's compile cache as `from_config`'s do."""
        cache = compile_cache.use(next(model.parameters()).device)
        cached_files = compile_cache.num_entries(cache)
        max_len = resolve_max_context_len(config, model.config)
        worker = Worker.from_config(model, config, max_len=max_len)
        eos = set(eos_token_ids) | set(model_eos_token_ids(model))
        generator = cls(
            LocalExecutor(worker), tokenizer, config, max_context_len=max_len, eos_token_ids=eos
        )
        generator.compile_cache = cache
        generator.compile_cache_files = cached_files
        return generator

    @classmethod
    def from_config(cls, model_path: str | os.PathLike, config: EngineConfig) -> Generator:
        """Load a checkpoint of a supported family: in this process with `tp_size` 1, else as
        rank 0 of a tensor-parallel group whose other ranks are Ray actors on this node."""
        from transformers import AutoConfig, AutoTokenizer

        start = time.perf_counter()
        adapter = adapter_for_checkpoint(model_path)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        cache = compile_cache.use(torch.device(device))
        cached_files = compile_cache.num_entries(cache)
        max_len = resolve_max_context_len(config, AutoConfig.from_pretrained(model_path))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if config.tp_size == 1:
            model = load_model_for_rank(adapter, model_path, tp_size=1, dtype=dtype, device=device)
            executor = LocalExecutor(Worker.from_config(model, config, max_len=max_len))
        else:
            from areno.engine.parallel.tp_executor import TPExecutor

            spec = {
                "model_path": str(model_path),
                "dtype": dtype,
                "device": device,
                "max_len": max_len,
                "config": config,
            }
            executor = TPExecutor.create(spec, num_cpus_per_rank=config.num_cpus_per_rank)
            model = executor.model
        eos = model_eos_token_ids(model)
        vocab = tokenizer.get_vocab()
        eos += [vocab[token] for token in adapter.stop_tokens if token in vocab]
        loaded = time.perf_counter() - start
        generator = cls(executor, tokenizer, config, max_context_len=max_len, eos_token_ids=eos)
        generator.start_up = {"load": loaded, **generator.start_up}
        generator.compile_cache = cache
        generator.compile_cache_files = cached_files
        log.info("start-up: %s", generator.describe_start_up())
        return generator

    # ---- public API -----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self.core.policy_version

    @property
    def is_paused(self) -> bool:
        return self._paused

    async def generate(
        self, inputs: PromptInputs, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's per-step deltas until it finishes.

        Raises at once for a request that can never run (prompt too long for max_context_len,
        n over the slot count, duplicate id). Leaving the iteration early (client gone, task
        cancelled) aborts the request and frees its cache slots. A request the engine cuts off
        (`pause(mode="abort")`, `shutdown`) ends with finish_reason "abort" and the delta's
        `abort_cause` saying why.
        """
        async for output in self._outputs(inputs, params, request_id, final_only=False):
            yield output

    async def _outputs(
        self, inputs: PromptInputs, params: SamplingParams, request_id: str | None, final_only: bool
    ) -> AsyncIterator[RequestOutput]:
        """`generate`'s stream. `final_only`: the engine thread keeps the deltas and hands them
        over together when the request finishes, so the caller's thread is not woken (and does
        not contend for the GIL with the engine thread) at every step. Otherwise the deltas that
        arrived while the caller was busy (forwarding the last one: a Serve replica's handle
        stream, an HTTP write) come as one: a caller slower than the engine's steps gets fewer,
        larger deltas, never a growing backlog of one message per step."""
        request_id = request_id or uuid.uuid4().hex
        self.core.check_request(inputs, params)
        if request_id in self._queues:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._queues[request_id] = (loop, queue, final_only)
        finished = False

        def add() -> None:
            try:
                self.core.add_request(request_id, inputs, params, stream=not final_only)
            except Exception as error:  # noqa: BLE001 - the caller raises it
                loop.call_soon_threadsafe(queue.put_nowait, error)

        try:
            # NOTE: not awaited: the request's first wake-up of this thread is its output (each
            # wake-up contends for the GIL with the engine thread, which runs the prefill next).
            self._post(add)
            while not finished:
                for output in _coalesced(await _ready(queue)):
                    finished = output.finished
                    yield output
        finally:
            self._queues.pop(request_id, None)
            if not finished and not self._stopped:
                self._submit(lambda: self.core.abort(request_id))

    async def generate_all(
        self, inputs: PromptInputs, params: SamplingParams, request_id: str | None = None
    ) -> RequestOutput:
        """Run a request to the end and return its samples merged (one delta per sample)."""
        outputs = self._outputs(inputs, params, request_id, final_only=True)
        return merge_outputs([out async for out in outputs])

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort" (cause CALLER)."""
        await self._call(lambda: self._deliver([self.core.abort(request_id)]))

    async def score(
        self, inputs: PromptInputs, adapter: str | None = None, *, num_top_logprobs: int = 0
    ) -> TokenScores:
        """Log-probabilities of tokens 1..N-1 of `inputs` (the prompt plus a continuation, with
        the prompt's media) under the current weights (with LoRA adapter `adapter`; None: the
        default), and at each of those positions the `num_top_logprobs` (0..20) most likely
        tokens: one full forward, no cache."""
        k = num_top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ConfigError(
                f"num_top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]; got {k!r}",
                param="num_top_logprobs",
            )
        executor = self.core.executor
        if adapter is None and executor.default_adapter is None:
            return await self._call(lambda: executor.score(inputs, k))
        return await self._call(lambda: executor.score_with_adapter(inputs, adapter, k))

    async def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Any,
        version: int,
    ) -> int:
        """Load new weights in place between two steps and set `policy_version`.

        `weights` maps parameter names to full tensors (or is an iterable of pairs, a Ray object
        ref to either, or `CudaIpcWeights` shared from a process on this GPU), or is a LoRA
        policy's `LoraWeights` (see `load_adapter`). Requests in flight continue on the new
        weights, their keys and values computed again under them (`_recompute_running`), so
        each later token is the new policy's given its prefix, and each token's
        `policy_versions` entry names the weights that sampled it. Returns the number of tensors
        loaded.
        """
        weights = _resolve(weights)
        if isinstance(weights, LoraWeights):
            return await self.load_adapter(POLICY_ADAPTER, weights, version=version)
        if isinstance(weights, CudaIpcWeights):
            weights = weights.open()
        pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)

        def load() -> int:
            # NOTE: no weights (a step that took no optimizer step) only moves the version: the
            # cached prefixes and the saved resume points of running episodes stay valid.
            count = self.core.executor.load_weights(pairs) if pairs else 0
            if count:
                self._recompute_running()
            self.core.policy_version = version
            return count

        return await self._call(load)

    def _recompute_running(self) -> None:
        """After new weights (on the engine thread, the step in flight read): every running
        request is prefilled again from its prompt and the tokens it has, and every cached
        block and saved state is forgotten. NOTE: without this a running request would attend
        to keys the old weights computed, and its next tokens would come from neither policy:
        an RL rollout stamps each token with the one version whose logprob it records
        (partial rollouts, docs/architecture.md)."""
        self.core.scheduler.recompute_running()
        self.core.scheduler.forget_cached()

    async def reset_prefix_cache(self) -> None:
        """Forget the cached prompt blocks and saved states between two steps, as new weights
        do: the next prompts prefill whole. Running requests keep their keys."""
        await self._call(self.core.scheduler.forget_cached)

    async def load_adapter(
        self, name: str, weights: LoraWeights | str | os.PathLike, *, version: int | None = None
    ) -> int:
        """Load LoRA adapter `name` (its factors, or a PEFT adapter directory) between two
        steps, or update it in place; requests pick it with `SamplingParams.adapter`. With
        `version` (an RL weight sync of a LoRA policy) it becomes the default adapter, which
        requests naming none run with, and the engine takes that policy version. Returns the
        number of adapted layers."""
        if not isinstance(weights, LoraWeights):
            weights = LoraWeights.from_dir(weights)
        default = version is not None

        def load() -> int:
            count = self.core.executor.load_adapter(name, weights, default=default)
            if default:  # the policy the running requests sample from changed
                self._recompute_running()
                self.core.policy_version = version
            else:
                self.core.scheduler.forget_cached()  # keys and states of its old factors
            return count

        return await self._call(load)

    async def pause(self, mode: str = "drain") -> None:
        """Stop stepping. "drain": admit nothing new and return once the running requests have
        finished; "keep": stop at once, in-flight requests stay in their slots and continue on
        `resume()`; "abort": abort every request (cause PAUSE), then stop. New requests queue
        meanwhile."""
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {PAUSE_MODES}; got {mode!r}")
        if mode == "abort":
            await self._call(lambda: self._abort_all(AbortCause.PAUSE))
        elif mode == "drain":
            await self._call(lambda: setattr(self.core.scheduler, "hold_admission", True))
            await asyncio.wrap_future(self._when_idle())
        await self._call(lambda: setattr(self, "_paused", True))

    async def resume(self) -> None:
        """Undo `pause`: admit and step again."""

        def resume() -> None:
            self._paused = False
            self.core.scheduler.hold_admission = False

        await self._call(resume)

    def warm_up(self, prompts: Mapping[str, PromptInputs]) -> None:
        """Prefill each named prompt once and drop what it computes, before the first request:
        the first use of each media tower lands here (areno/processing/warmup.py). Prompts that
        leave no room in the context are skipped. Blocks until done. Raises StartupRunError
        naming the prompt that failed."""

        start = time.perf_counter()

        def run() -> None:
            if self.core.has_work:
                raise RuntimeError("warm_up runs before any request (it prefills into slot 0)")
            for name, prompt in prompts.items():
                if prompt.num_prompt_tokens >= self.max_context_len:
                    continue  # a request like it would be refused: nothing to warm
                try:
                    startup.prefill_and_drop(self.core, prompt)
                except Exception as error:
                    raise StartupRunError(
                        f"the engine's start-up run of its {name} prompt failed: "
                        f"{type(error).__name__}: {error}"
                    ) from error

        self._submit(run).result()
        self.start_up["warm-up"] = time.perf_counter() - start

    def describe_start_up(self) -> str:
        """The start-up phases with their seconds and the compile cache, one line (see
        areno/engine/core/startup.py)."""
        return startup.describe(
            self.start_up,
            self.compile_cache,
            self.compile_cache_files,
            compile_cache.traces,
            self.start_up_compiles,
        )

    def add_adapters(self, adapters: Mapping[str, str | os.PathLike]) -> None:
        """Load LoRA adapters (name -> PEFT adapter directory) before serving; blocks until
        they are loaded. Raises LoraError naming the one that does not fit."""
        loaded = {name: LoraWeights.from_dir(path) for name, path in adapters.items()}

        def load() -> None:
            for name, weights in loaded.items():
                self.core.executor.load_adapter(name, weights)

        self._submit(load).result()

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine can no longer step: its thread is gone, or (tensor
        parallel) a follower rank stopped. Any thread may call it; Serve's replica health check
        does, so that such a replica is replaced instead of answering 503 to every request."""
        if self._stopped or not self._thread.is_alive():
            raise EngineDeadError("the engine thread has stopped")
        try:
            self.core.executor.check()
        except Exception as error:
            raise EngineDeadError(f"the engine cannot step: {error}") from error

    @property
    def pool(self):
        """The KV block pool (`KVPool`: blocks, block size, bytes; `describe()` for the log)."""
        return self.core.executor.pool

    def stats(self) -> dict[str, int | float]:
        """Queue depth, occupancy of slots and KV blocks, preemptions so far, and the prefix
        cache's blocks, saved states (held now; resumed from, saved and evicted so far), the
        prompt tokens it held of those admitted, the media tower calls it answered, and the
        seconds so far of steps that prefilled, decode-only steps and the towers' calls (read
        without locking: a snapshot for metrics)."""
        scheduler = self.core.scheduler
        media_encodes, media_encodes_cached, media_encode_s = self.core.executor.media_cache_stats()
        return {
            "num_waiting": scheduler.num_waiting,
            "num_running": scheduler.num_running,
            "num_free_slots": scheduler.num_free_slots,
            "num_blocks": scheduler.kv.blocks.num_blocks,
            "num_free_blocks": scheduler.kv.blocks.num_free,
            "num_preemptions": scheduler.num_preemptions,
            "num_cached_blocks": scheduler.kv.blocks.num_cached,
            "num_prompt_tokens_admitted": scheduler.num_admitted_tokens,
            "num_prompt_tokens_cached": scheduler.num_cached_tokens,
            "num_saved_states": len(scheduler.kv.states),
            "num_state_hits": scheduler.kv.states.num_hits,
            "num_state_saves": scheduler.kv.states.num_saves,
            "num_state_evictions": scheduler.kv.states.num_evictions,
            "num_media_encodes": media_encodes,
            "num_media_encodes_cached": media_encodes_cached,
            "policy_version": self.core.policy_version,
            "prefill_s": self.core.prefill_s,
            "decode_s": self.core.decode_s,
            "media_encode_s": media_encode_s,
        }

    def shutdown(self) -> None:
        """Stop the engine thread. Requests in flight end with finish_reason "abort" (cause
        SHUTDOWN), or with EngineDeadError where the engine thread cannot end them (it stopped,
        or is still in a step after SHUTDOWN_ABORT_S)."""
        if not self._stopped and self._thread.is_alive():
            ended = self._submit(lambda: self._abort_all(AbortCause.SHUTDOWN))
            # Not ended in time (or the thread stopped meanwhile): _fail_all below ends them.
            with contextlib.suppress(TimeoutError, EngineDeadError):
                ended.result(timeout=SHUTDOWN_ABORT_S)
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self.core.executor.shutdown()
        if self._holds_gc_freeze:
            self._holds_gc_freeze = False
            gc_freeze.release()

    # ---- the engine thread ----------------------------------------------------------------

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._stopped:
                future.set_exception(EngineDeadError("the engine is shut down"))
                return future
            self._commands.append((fn, future))
            self._wake.notify()
        return future

    def _post(self, fn: Callable[[], None]) -> None:
        """`_submit` for a command nobody waits for; it delivers its own errors."""
        with self._wake:
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            self._commands.append((fn, None))
            self._wake.notify()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit(fn))

    def _when_idle(self) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(lambda: self._idle_waiters.append(future))
        return future

    def _run(self) -> None:
        device = self.core.executor.device
        if device.type == "cuda":
            # The current GPU is per thread. Without this, a rank 0 on its process's second GPU
            # (tensor parallelism from a driver that sees every GPU) would make its decode
            # streams and CUDA graphs on the first one.
            torch.cuda.set_device(device)
        while True:
            with self._wake:
                while not (self._stopped or self._commands or self._can_step()):
                    self._wake.wait()
                if self._stopped:
                    return
                commands, self._commands = self._commands, []
            if commands and self.core.in_flight:
                self._step(flush_only=True)  # commands (aborts, weights, pauses) see none
            for fn, future in commands:
                _run_command(fn, future)
            if self._can_step():
                self._step()
            elif self._held:  # nothing steps next (paused, or the held requests preempted)
                self._deliver([], hold=False)
            if self.core.scheduler.num_running == 0 and self._idle_waiters:
                for future in self._idle_waiters:
                    future.set_result(None)
                self._idle_waiters = []

    def _can_step(self) -> bool:
        # Paused, the engine still reads the step it had in flight, and schedules nothing new.
        return self.core.in_flight if self._paused else self.core.has_work

    def _step(self, flush_only: bool = False) -> None:
        try:
            outputs = self.core.flush() if flush_only or self._paused else self.core.step()
        except Exception as e:  # noqa: BLE001 - fail the requests, keep the engine alive
            self._fail_all(EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"), e)
            self._abort_all(AbortCause.ENGINE_ERROR)
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput | None], *, hold: bool = True) -> None:
        """Hand requests' outputs to their callers: a final-only request's when it finishes, a
        streamed one's at most every `stream_interval_ms` (its first output and its end at
        once; `hold` False: all now). Held outputs reach the caller together, as one delta."""
        # One wake-up per event loop per step, not one per request: each wake-up makes the loop's
        # thread contend for the GIL with this one.
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        now = time.monotonic()
        for output in outputs:
            if output is None:
                continue
            request_id = output.request_id
            entry = self._queues.get(request_id)
            if entry is None:  # its caller is gone
                self._forget_outputs(request_id)
                continue
            loop, queue, final_only = entry
            kept = self._collected if final_only else self._held
            kept.setdefault(request_id, []).append(output)
            if not output.finished and (final_only or (hold and not self._due(request_id, now))):
                continue
            batches.setdefault(loop, []).append((queue, self._hand_over(request_id, kept, now)))
        # Streamed requests that hold outputs of earlier steps (none this step: preempted).
        for request_id in [r for r in self._held if not hold or self._due(r, now)]:
            entry = self._queues.get(request_id)
            if entry is None:
                self._forget_outputs(request_id)
                continue
            batch = batches.setdefault(entry[0], [])
            batch.append((entry[1], self._hand_over(request_id, self._held, now)))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _due(self, request_id: str, now: float) -> bool:
        """Whether a streamed request's held outputs go to its caller now."""
        last = self._handed_at.get(request_id)
        return last is None or now - last >= self.config.stream_interval_ms / 1e3

    def _hand_over(
        self, request_id: str, kept: dict[str, list[RequestOutput]], now: float
    ) -> list[RequestOutput]:
        outputs = kept.pop(request_id)
        if outputs[-1].finished:
            self._handed_at.pop(request_id, None)
        else:
            self._handed_at[request_id] = now
        return outputs

    def _forget_outputs(self, request_id: str) -> None:
        self._collected.pop(request_id, None)
        self._held.pop(request_id, None)
        self._handed_at.pop(request_id, None)

    def _abort_all(self, cause: AbortCause) -> None:
        for request_id in self.core.scheduler.request_ids():
            self._deliver([self.core.abort(request_id, cause)])

    def _fail_all(self, error: Exception, cause: Exception | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        self._collected.clear()
        self._held.clear()
        self._handed_at.clear()
        for loop, queue, _ in list(self._queues.values()):
            loop.call_soon_threadsafe(queue.put_nowait, error)


async def _ready(queue: asyncio.Queue) -> list[RequestOutput]:
    """The outputs in `queue`: at least one (waited for), and every one already there. An
    error the engine thread put there is raised."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    outputs = []
    for item in items:
        if isinstance(item, BaseException):
            raise item
        outputs += item if isinstance(item, list) else [item]
    return outputs


def _coalesced(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One request's consecutive deltas as one (`merge_outputs`; each token keeps the policy
    version that produced it), or the one delta as it is."""
    return outputs if len(outputs) == 1 else [merge_outputs(outputs)]


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


def _run_command(fn: Callable[[], Any], future: concurrent.futures.Future | None) -> None:
    if future is None:  # posted (`Generator._post`): it handles its own errors
        fn()
        return
    # NOTE: a caller cancelled while its command waited (a client gone before its request was
    # added) cancelled the future; the command is skipped, and setting a result there would
    # raise and end the engine thread.
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except BaseException as e:  # noqa: BLE001 - the caller receives it
        future.set_exception(e)
    else:
        future.set_result(result)


def _resolve(weights: Any) -> Any:
    if type(weights).__name__ == "ObjectRef":
        import ray

        return ray.get(weights)
    return weights


def model_eos_token_ids(model: torch.nn.Module) -> list[int]:
    """The EOS ids of the model's generation config (an int or a list there)."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list | tuple) else [eos]
