"""Ray Serve deployments: the worker classes of media / processing / engine, and the Ingress.

Each deployment wraps the very class that training uses as a Ray actor: `MediaDecoder`,
`Processor`, `Generator`. The Ingress is the OpenAI HTTP surface; a text-only request skips the
MediaDecoder hop.
"""

# NOTE: no `from __future__ import annotations` here: FastAPI reads the route signatures'
# annotations at runtime, and string annotations made `request: Request` a required query field.
import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import BackpressureConfig
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException

from areno.engine.generator import EngineDeadError, Generator
from areno.engine.outputs import merge_outputs
from areno.engine.sampling import SamplingParams
from areno.errors import ArenoError
from areno.logs import completions_logged
from areno.media import MediaDecoder, MediaPolicy
from areno.models.registry import adapter_for_checkpoint
from areno.processing import Processor
from areno.processing.encode import PromptLimits
from areno.processing.warmup import warm_up_prompts
from areno.protocol import parse_chat_request
from areno.protocol.errors import ErrorInfo, ErrorResponse, check_body_size
from areno.protocol.responses import ModelCard, ModelList
from areno.serve.admission import RETRY_AFTER_S, Admission, EngineUnavailableError
from areno.serve.config import ServeConfig
from areno.serve.openai_routes import (
    ChunkWriter,
    build_response,
    error_line,
    forced_prompt_text,
    forced_reply_prefix,
    parse_reply,
    reasoning_in_play,
    tools_in_play,
)
from areno.serve.sampling import sampling_params
from areno.tools import get_tool_parser

# HTTP requests the Serve proxy queues for the Ingress once every Ingress replica has
# INGRESS_MAX_ONGOING in flight; beyond that Serve itself answers 503 (plain text, with
# Retry-After). The engine-side limit (--max-queued-requests, 429) normally refuses far earlier.
INGRESS_MAX_ONGOING = 4096
INGRESS_MAX_QUEUED = 1024
# How long `/health` waits for the Generator replica to answer before saying it is still starting.
ENGINE_PROBE_S = 1.0

# Children of "ray.serve": Serve routes them to the replica's log file and the driver's console.
logger = logging.getLogger("ray.serve.areno")
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


class ModelNotFoundError(ArenoError):
    status_code = 404
    code = "model_not_found"


class AuthenticationError(ArenoError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ReplicaLostError(ArenoError):
    """A replica died while it held the request (a crash, a kill, a lost node). Serve starts a
    replacement, so this is 503 with Retry-After, not an internal error: retrying succeeds."""

    status_code = 503
    error_type = "server_error"
    code = "replica_unavailable"
    retry_after_s = RETRY_AFTER_S


async def _read_body(request: Request) -> bytes:
    """The body, refused (413) as soon as its declared or received size is over the limit, so
    an oversized or lying upload is never buffered whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        check_body_size(int(declared))
    chunks, num_bytes = [], 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        check_body_size(num_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _user_error(error: Exception) -> ArenoError:
    """The ArenoError behind `error` (Ray wraps a replica's exception in RayTaskError), or a
    generic server error for anything else (logged, never shown to the client)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, ArenoError):
        return cause
    if isinstance(error, ArenoError) and hasattr(error, "message"):
        return error
    if isinstance(cause, EngineDeadError) or isinstance(error, EngineDeadError):
        return EngineUnavailableError("the generation engine is restarting; retry shortly")
    if isinstance(cause, BackPressureError) or isinstance(error, BackPressureError):
        return EngineUnavailableError("the server is overloaded; retry shortly")
    if isinstance(cause, RayActorError) or isinstance(error, RayActorError):
        logger.warning("a replica died while serving a request: %s", error)
        return ReplicaLostError(
            "a server replica stopped while handling this request; its replacement is "
            "starting, retry shortly"
        )
    logger.exception("internal error", exc_info=error)
    internal = ArenoError("internal server error; see the server log")
    internal.status_code, internal.error_type, internal.code = 500, "server_error", "internal"
    return internal


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

    def decode_many(self, refs: list) -> list:
        decoded = []
        for ref in refs:
            start = time.perf_counter()
            decoded.append(self.decoder.decode(ref))
            self.decode_seconds.observe(
                time.perf_counter() - start, tags={"modality": ref.modality}
            )
        return decoded


@serve.deployment(max_ongoing_requests=64)
class ProcessorServer:
    """Chat template + native processor: messages and decoded media to PromptInputs (requests
    with media; the Ingress encodes text-only requests itself)."""

    def __init__(self, config: ServeConfig):
        limits = PromptLimits(config.max_prompt_tokens, config.engine.max_context_len)
        self.processor = Processor(config.model_path, limits=limits)
        warm_up_prompts(self.processor)  # the native processor's first call, per modality

    def encode(
        self,
        messages: list,
        media: list,
        tools: list | None,
        template_kwargs: Any,
        max_new_tokens: int | None = None,
    ):
        return self.processor.encode(
            messages,
            media,
            tools=tools,
            chat_template_kwargs=template_kwargs,
            max_new_tokens=max_new_tokens,
        )


@serve.deployment(max_ongoing_requests=4096)
class GeneratorServer:
    """One replica is one engine: a tensor-parallel group when tp_size > 1 (this replica is
    rank 0, in the first bundle of its STRICT_PACK placement group)."""

    def __init__(self, config: ServeConfig):
        # Encoded before the engine starts: its thread must stay this process's only OpenMP user
        # (areno/engine/openmp.py), and the processor runs torch ops.
        limits = PromptLimits(config.max_prompt_tokens, config.engine.max_context_len)
        start_up_prompts = warm_up_prompts(Processor(config.model_path, limits=limits))
        self.generator = Generator.from_config(config.model_path, config.engine)
        # Each media tower's first forward, here rather than in a user's first request of it.
        self.generator.warm_up(start_up_prompts)
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
        }
        self._counted = dict.fromkeys(self.counters, 0)
        logger.info("%s", self.generator.pool.describe(self.generator.max_context_len))

    async def generate_all(self, inputs, params: SamplingParams, request_id: str):
        """The whole request in one reply (non-streaming HTTP: no per-delta handle traffic)."""
        self._admit(params, request_id)
        try:
            return await self.generator.generate_all(inputs, params, request_id)
        finally:
            self._release(request_id)

    async def generate(self, inputs, params: SamplingParams, request_id: str):
        self._admit(params, request_id)
        try:
            async for output in self.generator.generate(inputs, params, request_id):
                yield output
        finally:
            self._release(request_id)

    def _admit(self, params: SamplingParams, request_id: str) -> None:
        """Refuse at once what would otherwise hang: 503 while the engine is paused (an RL
        weight update), 429 when the waiting queue is full. A dead engine raises
        EngineDeadError from `generate` itself (503 too)."""
        if self.generator.is_paused:
            raise EngineUnavailableError("the generation engine is paused; retry shortly")
        self.admission.admit(request_id, params.n)
        self._report()

    def _release(self, request_id: str) -> None:
        self.admission.release(request_id)
        self._report()

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

    def check_health(self) -> None:
        """Serve's periodic replica check: an engine that cannot step (a lost tensor-parallel
        follower) fails it, and Serve replaces this replica, its placement group and followers."""
        self.generator.check_health()

    def __del__(self) -> None:
        generator = getattr(self, "generator", None)
        if generator is not None:
            generator.shutdown()


# No /docs, /redoc or /openapi.json: they would answer without the API key.
api = FastAPI(title="AReno", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's own refusals (an unknown route, a wrong method) as OpenAI error bodies."""
    detail = str(exc.detail)
    error = ErrorInfo(
        message=f"{detail}: {request.method} {request.url.path}",
        type="invalid_request_error",
        code=detail.lower().replace(" ", "_"),
    )
    body = ErrorResponse(error=error).model_dump()
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


@serve.deployment(
    max_ongoing_requests=INGRESS_MAX_ONGOING,
    max_queued_requests=INGRESS_MAX_QUEUED,
    backpressure_config=BackpressureConfig(status_code=503, retry_after_s=RETRY_AFTER_S),
)
@serve.ingress(api)
class Ingress:
    """`POST /v1/chat/completions`, `GET /v1/models`, `GET /health`."""

    def __init__(self, decoder, processor, generator, config: ServeConfig):
        from transformers import AutoTokenizer

        self.decoder, self.processor = decoder, processor
        self.generator_unary = generator
        self.generator = generator.options(stream=True)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        # Text-only requests are templated and tokenized here, sparing them a Serve hop; the
        # Processor deployment takes the requests that carry media.
        limits = PromptLimits(config.max_prompt_tokens, config.engine.max_context_len)
        self.text_processor = Processor(config.model_path, limits=limits)
        # One thread: a fast tokenizer must not be entered by two threads at once.
        self.encode_thread = concurrent.futures.ThreadPoolExecutor(1, "areno-encode")
        self.tool_parser = get_tool_parser(adapter_for_checkpoint(config.model_path).tool_format)
        self.metrics = IngressMetrics()
        self.engine_ready = False

    @api.get("/health")
    async def health(self):
        """200 once the engine has started; 503 before. The Ingress answers HTTP as soon as its
        own replica is up, while the Generator may still be loading the checkpoint and compiling
        its decode step (minutes for a 2B model on a GPU), so readiness asks the engine itself."""
        if not self.engine_ready:
            probe = self.generator_unary.stats.remote()
            try:
                await asyncio.wait_for(asyncio.shield(probe), ENGINE_PROBE_S)
            except TimeoutError:
                probe.cancel()
                detail = "the generation engine is still starting (loading, compiling, warming up)"
                return JSONResponse({"status": "starting", "detail": detail}, status_code=503)
            except Exception as error:  # a replica that failed to start: say why, stay up
                detail = f"the generation engine is unavailable: {error}"
                return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)
            self.engine_ready = True
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request):
        if (denied := self._check_key(request)) is not None:
            return denied
        card = ModelCard(
            id=self.config.model_name,
            root=self.config.model_path,
            max_model_len=self.config.engine.max_context_len,
        )
        return JSONResponse(ModelList(data=[card]).model_dump(exclude_none=True))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        if (denied := self._check_key(request)) is not None:
            return denied
        arrival = time.perf_counter()
        try:
            chat = parse_chat_request(await _read_body(request))
            if chat.model is not None and chat.model != self.config.model_name:
                raise ModelNotFoundError(
                    f"model {chat.model!r} is not served here; this server serves "
                    f"{self.config.model_name!r}",
                    param="model",
                )
            params = sampling_params(chat)
            parser = self.tool_parser if tools_in_play(chat) else None
            prefix = forced_reply_prefix(chat, parser)
            encoded = await self._encode(chat)
            thinking = reasoning_in_play(encoded.prompt_text, prefix)
            if parser is not None or thinking:
                # Tool-call and reasoning tags may be special tokens: keep them in the text.
                params = dataclasses.replace(params, skip_special_tokens=False)
            inputs = self._force_prefix(encoded, prefix)
            request_id = uuid.uuid4().hex
            if not chat.stream:
                merged = await self.generator_unary.generate_all.remote(inputs, params, request_id)
                return self._respond(chat, inputs, merged, parser, prefix, thinking, arrival)
            stream = self.generator.generate.remote(inputs, params, request_id)
            first = await stream.__anext__()  # request-level errors surface before any byte
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error response
            return self._error(e)
        first_token_at = time.perf_counter()
        self.metrics.time_to_first_token.observe(first_token_at - arrival)
        writer = ChunkWriter(
            chat, self.config.model_name, inputs, self.tokenizer, parser, prefix, thinking
        )
        return StreamingResponse(
            self._sse(writer, first, stream, first_token_at), media_type="text/event-stream"
        )

    def _force_prefix(self, inputs, prefix: str):
        """The prompt followed by the forced call opening (tool_choice "required" or named):
        the model continues a call it cannot avoid. No grammar engine needed."""
        if not prefix:
            return inputs
        text = forced_prompt_text(inputs.prompt_text, prefix)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return inputs.with_tokens(inputs.input_ids + ids)

    def _respond(
        self, chat, inputs, merged, parser, prefix: str, thinking: bool, arrival: float
    ) -> JSONResponse:
        """The JSON answer of a non-streaming request (its tokens/s include the prefill: the
        first token's time is not known here)."""
        model = self.config.model_name
        response = build_response(
            chat, model, inputs, merged, self.tokenizer, parser, prefix, thinking
        )
        malformed = sum(
            parse_reply(chat, d.text, parser, prefix, thinking)[1].num_malformed
            for d in merged.samples
        )
        self._record(chat, inputs, response.model_dump(), arrival, malformed)
        return JSONResponse(response.model_dump(exclude_none=True))

    def _record(self, chat, inputs, body: dict, first_token_at: float, malformed: int) -> None:
        """Metrics of a finished request, and its log line with ARENO_LOG_COMPLETIONS=1."""
        usage = body.get("usage") or {}
        completion_tokens = usage.get("completion_tokens", 0)
        elapsed = time.perf_counter() - first_token_at
        self.metrics.requests.inc(tags={"status": "200"})
        self.metrics.prompt_tokens.inc(inputs.num_prompt_tokens)
        self.metrics.completion_tokens.inc(completion_tokens)
        if malformed:
            self.metrics.malformed_tool_calls.inc(malformed)
        if completion_tokens > 1 and elapsed > 0:
            self.metrics.tokens_per_s.observe((completion_tokens - 1) / elapsed)
        if completions_logged():
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
            line = {
                "id": body.get("id"),
                "prompt_tokens": inputs.num_prompt_tokens,
                "completion_tokens": completion_tokens,
                "malformed_tool_calls": malformed,
                "choices": choices,
            }
            completion_logger.info("completion %s", json.dumps(line, ensure_ascii=False))

    async def _encode(self, chat):
        """PromptInputs of the request: text-only ones encoded here (on the encode thread, off the
        event loop), the others through MediaDecoder then Processor."""
        tools = chat.tools if tools_in_play(chat) else None
        kwargs = chat.chat_template_kwargs
        refs = self.text_processor.media_refs(chat.messages)
        if not refs:
            encode = functools.partial(
                self.text_processor.encode,
                tools=tools,
                chat_template_kwargs=kwargs,
                max_new_tokens=chat.max_new_tokens,
            )
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.encode_thread, encode, chat.messages, [])
        media = await self.decoder.decode_many.remote(refs)
        return await self.processor.encode.remote(
            chat.messages, media, tools, kwargs, chat.max_new_tokens
        )

    async def _sse(self, writer: ChunkWriter, first, stream, first_token_at: float):
        try:
            outputs = [first]
            for line in writer.chunks(first):
                yield line
            async for output in stream:
                outputs.append(output)
                for line in writer.chunks(output):
                    yield line
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-stream
            yield error_line(ErrorResponse.from_error(_user_error(e)).error.model_dump())
            return
        for line in writer.end():
            yield line
        merged = merge_outputs(outputs)
        body = build_response(
            writer.request,
            writer.model,
            writer.inputs,
            merged,
            self.tokenizer,
            writer.parser,
            writer.prefix,
            writer.thinking,
        ).model_dump()
        malformed = writer.num_malformed_tool_calls
        self._record(writer.request, writer.inputs, body, first_token_at, malformed)

    def _check_key(self, request: Request) -> JSONResponse | None:
        key = self.config.api_key
        sent = request.headers.get("authorization", "").encode()
        if key is None or hmac.compare_digest(sent, f"Bearer {key}".encode()):
            return None
        return self._error(
            AuthenticationError("missing or wrong API key: send 'Authorization: Bearer <key>'")
        )

    def _error(self, error: Exception) -> JSONResponse:
        user_error = _user_error(error)
        self.metrics.requests.inc(tags={"status": str(user_error.status_code)})
        body = ErrorResponse.from_error(user_error).model_dump()
        retry_after = getattr(user_error, "retry_after_s", None)
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        return JSONResponse(body, status_code=user_error.status_code, headers=headers)
