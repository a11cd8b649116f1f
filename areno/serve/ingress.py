"""The Ingress: the OpenAI HTTP surface of an AReno app (`/v1/chat/completions`,
`/v1/responses`, `/v1/completions`, `/v1/models`, `/health`) on FastAPI inside Ray Serve.

A chat request's path: read and parse the body, check the model and key, encode the prompt (a
text-only request here, one with media through the MediaDecoder and Processor deployments as a
chain: the Ingress gets back only the token ids, spans and text, and passes the reference to the
media tensors on to the Generator), `prepare` it (areno.serve.chat), call the Generator
deployment, and write the reply as JSON or SSE from that one `PreparedChat`. A Responses request
is served as the chat request it translates into, its reply and events written in its own shape
(areno.serve.responses_api). A completions request
(areno.serve.completions) is a batch of raw prompts, tokenized here, each run as its own Generator
request side by side (areno.serve.fanout), its prompts scored first when `echo` asks for their
logprobs.
"""

# NOTE: no `from __future__ import annotations` here: FastAPI reads the route signatures'
# annotations at runtime, and string annotations made `request: Request` a required query field.
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hmac
import logging
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.config import BackpressureConfig
from starlette.exceptions import HTTPException

from areno.engine.sampling import SamplingParams
from areno.models.registry import adapter_for_checkpoint
from areno.processing import Processor
from areno.processing.encode import PromptLimits
from areno.protocol import parse_chat_request, parse_completion_request
from areno.protocol.errors import ErrorInfo, ErrorResponse, check_body_size
from areno.protocol.responses import ModelCard, ModelList
from areno.protocol.responses_api import parse_responses_request, to_chat_request
from areno.serve.admission import RETRY_AFTER_S
from areno.serve.chat import (
    ChunkWriter,
    PreparedChat,
    build_response,
    error_line,
    prepare,
    tools_in_play,
)
from areno.serve.completions import (
    CompletionChunkWriter,
    PreparedCompletion,
    build_completion_response,
    encode_prompts,
)
from areno.serve.config import ServeConfig
from areno.serve.disconnects import QuietDisconnects
from areno.serve.drain import Drain, DrainGate, DrainReport
from areno.serve.errors import AuthenticationError, ModelNotFoundError, unwrap, user_error
from areno.serve.fanout import PromptBatch
from areno.serve.first_requests import first_messages
from areno.serve.metrics import IngressMetrics
from areno.serve.responses_api import ResponseEventWriter, build_reply
from areno.serve.sampling import completion_sampling_params, sampling_params
from areno.serve.timing import HopTimes
from areno.tools import get_tool_parser

# Under Serve's logger: its lines land in the Ingress replica's log file.
log = logging.getLogger("ray.serve.areno.ingress")

# HTTP requests the Serve proxy queues for the Ingress once every Ingress replica has
# INGRESS_MAX_ONGOING in flight; beyond that Serve itself answers 503 (plain text, with
# Retry-After). The engine-side limit (--max-queued-requests, 429) normally refuses far earlier.
INGRESS_MAX_ONGOING = 4096
INGRESS_MAX_QUEUED = 1024
# How long `/health` waits for the Generator replica to answer before saying it is still starting.
ENGINE_PROBE_S = 1.0
# A text-only request whose body is at most this many bytes is encoded on the event loop: its
# template and tokenizer call take well under a millisecond, less than the two thread hand-offs
# of the encode thread cost on a busy machine. Larger prompts go to the encode thread.
INLINE_ENCODE_MAX_BYTES = 4096


async def read_body(request: Request) -> bytes:
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


# No /docs, /redoc or /openapi.json: they would answer without the API key.
api = FastAPI(title="AReno", docs_url=None, redoc_url=None, openapi_url=None)
api.add_middleware(QuietDisconnects)
api.add_middleware(DrainGate)  # outermost: a refused request never reaches the routes


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
    """`POST /v1/chat/completions`, `POST /v1/responses`, `POST /v1/completions`,
    `GET /v1/models`, `GET /health`."""

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
        # One thread: a fast tokenizer must not be entered by two threads at once. The lock
        # keeps the event loop's inline encodes (small prompts) off it while that thread runs.
        self.encode_thread = concurrent.futures.ThreadPoolExecutor(1, "areno-encode")
        self.encode_lock = threading.Lock()
        self.tool_parser = get_tool_parser(adapter_for_checkpoint(config.model_path).tool_format)
        self.metrics = IngressMetrics()
        self.engine_ready = False
        self._first_requests: asyncio.Future | None = None
        # NOTE: one Ingress replica a process, so the app's state is this replica's own.
        self.drain = api.state.drain = Drain()

    async def drain_requests(self, grace_s: float) -> DrainReport:
        """Stop admitting (503 with Retry-After, `/health` too), let the requests in flight
        finish for up to `grace_s`, then cut off the rest (areno/serve/drain.py). Called by
        `areno serve` on SIGTERM / Ctrl-C through a deployment handle."""
        return await self.drain.run(grace_s)

    def end_grace(self) -> None:
        """Cut a running drain's grace period short (a second signal)."""
        self.drain.end_grace()

    @api.get("/health")
    async def health(self):
        """200 once the engine has started and the first request of each kind has been sent
        (areno/serve/first_requests.py); 503 before. The Ingress answers HTTP as soon as its
        own replica is up, while the Generator may still be loading the checkpoint and compiling
        its decode step (minutes for a 2B model on a GPU), so readiness asks the engine itself."""
        if not self.engine_ready:
            probe = self.generator_unary.stats.remote()
            waiting = asyncio.ensure_future(probe)
            try:
                await asyncio.wait_for(asyncio.shield(waiting), ENGINE_PROBE_S)
            except TimeoutError:
                probe.cancel()
                # Its cancellation is expected: read, so asyncio prints no "never retrieved".
                waiting.add_done_callback(lambda done: done.cancelled() or done.exception())
                detail = "the generation engine is still starting (loading, compiling, warming up)"
                return JSONResponse({"status": "starting", "detail": detail}, status_code=503)
            except Exception as error:  # a replica that failed to start: say why, stay up
                detail = f"the generation engine is unavailable: {error}"
                return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)
            if not self._first_requests_sent().done():
                detail = "the server is sending its first request of each kind"
                return JSONResponse({"status": "starting", "detail": detail}, status_code=503)
            self.engine_ready = True
        return {"status": "ok"}

    async def check_health(self) -> None:
        """Serve's periodic health check of this replica: it starts the first requests where
        nothing asks `/health` (an app that `serve run` or a RayService deploys)."""
        self._first_requests_sent()

    def _first_requests_sent(self) -> asyncio.Future:
        """The first requests' task, started on the first call (`_send_first_requests`)."""
        if self._first_requests is None:
            self._first_requests = asyncio.ensure_future(self._send_first_requests())
        return self._first_requests

    async def _send_first_requests(self) -> None:
        """One request of one token per kind (text, streamed text, each modality the family
        accepts) along a user's way; a kind that fails is logged and left to its first user."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        sent = []
        for kind, messages in first_messages(self.text_processor.adapter.modalities).items():
            try:
                if kind == "text":
                    encode = functools.partial(self._encode_text, messages)
                    loop = asyncio.get_running_loop()
                    inputs = await loop.run_in_executor(self.encode_thread, encode)
                    args = (inputs, params, uuid.uuid4().hex, None)
                    unwrap(await self.generator_unary.generate_all.remote(*args))
                    args = (inputs, params, uuid.uuid4().hex, None)
                    async for item in self.generator.generate.remote(*args):
                        unwrap(item)
                    sent.append(kind)
                    continue
                media = self.decoder.decode_many.remote(self.text_processor.media_refs(messages))
                stored = unwrap(await self.processor.encode.remote(messages, media, None, None, 1))
                args = (stored.inputs, params, uuid.uuid4().hex, stored.ref)
                unwrap(await self.generator_unary.generate_all.remote(*args))
                sent.append(kind)
            except Exception as error:  # noqa: BLE001 - a warm-up; the server serves without it
                log.warning("the first %s request before serving failed: %s", kind, error)
        log.info("sent the first request of each kind before serving: %s", ", ".join(sent))

    @api.get("/v1/models")
    async def models(self, request: Request):
        if (denied := self._check_key(request)) is not None:
            return denied
        return JSONResponse(ModelList(data=self._cards()).model_dump(exclude_none=True))

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        """One model's card (the `openai` client's `models.retrieve`); 404 for another name."""
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            name = self._model(model)
        except ModelNotFoundError as e:
            return self._error(e)
        card = next(card for card in self._cards() if card.id == name)
        return JSONResponse(card.model_dump(exclude_none=True))

    def _cards(self) -> list[ModelCard]:
        """The base model and each LoRA adapter served beside it, with the context length."""
        config = self.config
        max_len = config.engine.max_context_len
        cards = [ModelCard(id=config.model_name, root=config.model_path, max_model_len=max_len)]
        cards += [
            ModelCard(id=name, root=path, parent=config.model_name, max_model_len=max_len)
            for name, path in config.lora_adapters.items()
        ]
        return cards

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        if (denied := self._check_key(request)) is not None:
            return denied
        arrival = time.perf_counter()
        hops = HopTimes(arrival)
        try:
            body = await read_body(request)
            hops.lap("read")
            chat = parse_chat_request(body)
            prepared, model, args = await self._prepare_chat(chat, len(body), hops)
            if not chat.stream:
                merged = await self.drain.hold(self.generator_unary.generate_all.remote(*args))
                merged = unwrap(merged)
                hops.lap("generate")
                hops.add_engine(merged.timings)
                return self._respond(prepared, model, merged, arrival, hops)
            stream = self.drain.hold(self.generator.generate.remote(*args))
            first = unwrap(await stream.__anext__())  # request-level errors: before any byte
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error response
            return self._error(e)
        first_token_at = time.perf_counter()
        hops.lap("first-token")
        self.metrics.time_to_first_token.observe(first_token_at - arrival)
        writer = ChunkWriter(prepared, model, self.tokenizer)
        return StreamingResponse(
            self._sse(writer, first, stream, first_token_at),
            media_type="text/event-stream",
            headers=hops.header(),
        )

    @api.post("/v1/responses")
    async def responses(self, request: Request):
        """The Responses API, served as the chat request it translates into
        (areno.protocol.responses_api) and answered in its own shape (areno.serve.responses_api)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        arrival = time.perf_counter()
        hops = HopTimes(arrival)
        try:
            body = await read_body(request)
            hops.lap("read")
            responses_request = parse_responses_request(body)
            chat = to_chat_request(responses_request)
            prepared, model, args = await self._prepare_chat(chat, len(body), hops)
            if not chat.stream:
                call = self.drain.hold(self.generator_unary.generate_all.remote(*args))
                merged = unwrap(await call)
                hops.lap("generate")
                hops.add_engine(merged.timings)
                reply, malformed = build_response(prepared, model, merged, self.tokenizer)
                self.metrics.record(
                    prepared, reply.model_dump(exclude_none=True), arrival, malformed
                )
                answer = build_reply(responses_request, reply, model, self.tokenizer)
                body = answer.model_dump(mode="json", by_alias=True)
                hops.lap("reply")
                return JSONResponse(body, headers=hops.header())
            stream = self.drain.hold(self.generator.generate.remote(*args))
            first = unwrap(await stream.__anext__())  # request-level errors: before any byte
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error response
            return self._error(e)
        first_token_at = time.perf_counter()
        hops.lap("first-token")
        self.metrics.time_to_first_token.observe(first_token_at - arrival)
        writer = ResponseEventWriter(responses_request, prepared, model, self.tokenizer)
        return StreamingResponse(
            self._sse(writer, first, stream, first_token_at),
            media_type="text/event-stream",
            headers=hops.header(),
        )

    async def _prepare_chat(self, chat, body_size: int, hops: HopTimes):
        """A chat request's model checked, its prompt encoded and `prepare`d: the PreparedChat,
        the model, and the Generator call's arguments."""
        model = self._model(chat.model)
        params = sampling_params(chat)  # refused before the prompt is encoded
        if model in self.config.lora_adapters:
            params = dataclasses.replace(params, adapter=model)
        hops.lap("parse")
        encoded, stored = await self._encode(chat, body_size, hops)
        prepared = prepare(chat, params, encoded, self.tool_parser, self.tokenizer)
        return prepared, model, (prepared.inputs, prepared.params, uuid.uuid4().hex, stored)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        if (denied := self._check_key(request)) is not None:
            return denied
        arrival = time.perf_counter()
        try:
            prepared, model = await self._prepare_completion(await read_body(request))
            batch = PromptBatch(self.generator_unary, self.generator, prepared, uuid.uuid4().hex)
            self.drain.hold(batch)
            scores = await batch.scores()
            if not prepared.request.stream:
                outputs = await batch.outputs()
                response = build_completion_response(
                    prepared, model, scores, outputs, self.tokenizer
                )
                body = response.model_dump()
                self.metrics.record_text_completion(body, arrival)
                return JSONResponse(body)
            firsts = await batch.open_streams()
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error response
            return self._error(e)
        first_token_at = time.perf_counter()
        self.metrics.time_to_first_token.observe(first_token_at - arrival)
        writer = CompletionChunkWriter(prepared, model, scores, self.tokenizer)
        return StreamingResponse(
            self._completion_sse(writer, batch, firsts, first_token_at),
            media_type="text/event-stream",
        )

    async def _prepare_completion(self, data: bytes) -> tuple[PreparedCompletion, str]:
        """The request read, its model and sampling parameters checked, its prompts encoded."""
        body = parse_completion_request(data)
        model = self._model(body.model)
        adapter = model if model in self.config.lora_adapters else None
        params = completion_sampling_params(body)  # refused before the prompts are encoded
        if params is not None and adapter is not None:
            params = dataclasses.replace(params, adapter=adapter)
        processor = self.text_processor  # its tokenizer belongs to the encode thread
        encode = functools.partial(encode_prompts, body, processor.tokenizer, processor.limits)
        prompts = await asyncio.get_running_loop().run_in_executor(self.encode_thread, encode)
        return PreparedCompletion(body, params, prompts, adapter), model

    async def _completion_sse(self, writer, batch: PromptBatch, firsts, first_token_at: float):
        try:
            for line in writer.start():
                yield line
            for i, first in enumerate(firsts):
                for line in writer.chunks(i, first):
                    yield line
            # Closed with this generator (a client gone): that cancels the prompts' requests.
            async with contextlib.aclosing(batch.rest()) as rest:
                async for i, output in rest:
                    for line in writer.chunks(i, output):
                        yield line
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-stream
            yield error_line(ErrorResponse.from_error(self._user_error(e)).error.model_dump())
            return
        for line in writer.end():
            yield line
        self.metrics.record_text_completion(writer.summary(), first_token_at)

    def _model(self, requested: str | None) -> str:
        """The model a request runs on: the base model (named, or not named at all) or a LoRA
        adapter served beside it (`--lora`)."""
        if requested is None:
            return self.config.model_name
        if requested not in self.config.model_names:
            served = ", ".join(repr(name) for name in self.config.model_names)
            raise ModelNotFoundError(
                f"model {requested!r} is not served here; this server serves {served}",
                param="model",
            )
        return requested

    def _respond(
        self, prepared: PreparedChat, model: str, merged, arrival: float, hops: HopTimes
    ) -> JSONResponse:
        """The JSON answer of a non-streaming request (its tokens/s include the prefill: the
        first token's time is not known here). The metrics read the same dump as the reply."""
        response, malformed = build_response(prepared, model, merged, self.tokenizer)
        body = response.model_dump(exclude_none=True)
        self.metrics.record(prepared, body, arrival, malformed)
        hops.lap("reply")
        return JSONResponse(body, headers=hops.header())

    async def _encode(self, chat, body_size: int | None, hops: HopTimes):
        """The request's PromptInputs and, for one with media, the reference to its whole
        prompt (a `StoredPrompt`; None for text). Text-only requests are encoded here (a small one
        on the event loop when the tokenizer is free, see INLINE_ENCODE_MAX_BYTES, the others on
        the encode thread); those with media go through MediaDecoder then Processor, the
        decoded media passed between them by Ray, never through this replica."""
        tools = chat.tools if tools_in_play(chat) else None
        kwargs = chat.chat_template_kwargs
        refs = self.text_processor.media_refs(chat.messages)
        if not refs:
            options = {
                "tools": tools,
                "chat_template_kwargs": kwargs,
                "max_new_tokens": chat.max_new_tokens,
            }
            small = body_size is not None and body_size <= INLINE_ENCODE_MAX_BYTES
            if small and self.encode_lock.acquire(blocking=False):
                try:
                    encoded = self.text_processor.encode(chat.messages, [], **options)
                finally:
                    self.encode_lock.release()
            else:
                encode = functools.partial(self._encode_text, chat.messages, **options)
                loop = asyncio.get_running_loop()
                encoded = await loop.run_in_executor(self.encode_thread, encode)
            hops.lap("encode")
            return encoded, None
        media = self.decoder.decode_many.remote(refs)  # resolved in the Processor replica
        encoded = self.processor.encode.remote(
            chat.messages, media, tools, kwargs, chat.max_new_tokens
        )
        stored = unwrap(await encoded)
        hops.lap("prompt")
        hops.add("media-decode", stored.decode_s)
        hops.add("media-process", stored.process_s)
        return stored.inputs, stored.ref

    def _encode_text(self, messages, **kwargs):
        """The encode thread's call: it holds the lock the event loop's inline encodes take."""
        with self.encode_lock:
            return self.text_processor.encode(messages, [], **kwargs)

    async def _sse(self, writer, first, stream, first_token_at: float):
        """A chat ChunkWriter's or a ResponseEventWriter's SSE lines."""
        try:
            for line in writer.chunks(first):
                yield line
            async for item in stream:
                for line in writer.chunks(unwrap(item)):
                    yield line
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-stream
            error = self._user_error(e)
            self.metrics.requests.inc(tags={"status": str(error.status_code)})
            for line in writer.failure(ErrorResponse.from_error(error).error.model_dump()):
                yield line
            return
        for line in writer.end():
            yield line
        body = writer.summary().model_dump()
        self.metrics.record(writer.prepared, body, first_token_at, writer.num_malformed_tool_calls)

    def _check_key(self, request: Request) -> JSONResponse | None:
        key = self.config.api_key
        sent = request.headers.get("authorization", "").encode()
        if key is None or hmac.compare_digest(sent, f"Bearer {key}".encode()):
            return None
        return self._error(
            AuthenticationError("missing or wrong API key: send 'Authorization: Bearer <key>'")
        )

    def _user_error(self, exc: Exception):
        """What the client is told of `exc`: the drain's error once the grace period ran out
        (the request's Generator call was cancelled), else `user_error`'s."""
        return self.drain.cut_off_error() or user_error(exc)

    def _error(self, exc: Exception) -> JSONResponse:
        error = self._user_error(exc)
        self.metrics.requests.inc(tags={"status": str(error.status_code)})
        body = ErrorResponse.from_error(error).model_dump()
        retry_after = getattr(error, "retry_after_s", None)
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        return JSONResponse(body, status_code=error.status_code, headers=headers)
