"""Ray Serve deployments: the worker classes of media / processing / engine, and the Ingress.

Each deployment wraps the very class that training uses as a Ray actor: `MediaDecoder`,
`Processor`, `Generator`. The Ingress is the OpenAI HTTP surface; a text-only request skips the
MediaDecoder hop.
"""

# NOTE: no `from __future__ import annotations` here: FastAPI reads the route signatures'
# annotations at runtime, and string annotations made `request: Request` a required query field.
import dataclasses
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from areno.engine.generator import EngineDeadError, Generator
from areno.engine.sampling import SamplingParams
from areno.errors import ArenoError
from areno.media import MediaDecoder, MediaPolicy
from areno.models.registry import adapter_for_checkpoint
from areno.processing import Processor
from areno.processing.encode import PromptLimits
from areno.protocol import parse_chat_request
from areno.protocol.errors import ErrorResponse
from areno.protocol.responses import ModelCard, ModelList
from areno.serve.config import ServeConfig
from areno.serve.openai_routes import ChunkWriter, build_response, error_line, tools_in_play
from areno.tools import get_tool_parser

logger = logging.getLogger("areno.serve")


class ModelNotFoundError(ArenoError):
    status_code = 404
    code = "model_not_found"


class AuthenticationError(ArenoError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ServerOverloadedError(ArenoError):
    status_code = 503
    error_type = "server_error"
    code = "engine_unavailable"


def _user_error(error: Exception) -> ArenoError:
    """The ArenoError behind `error` (Ray wraps a replica's exception in RayTaskError), or a
    generic server error for anything else (logged, never shown to the client)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, ArenoError):
        return cause
    if isinstance(error, ArenoError) and hasattr(error, "message"):
        return error
    if isinstance(cause, EngineDeadError) or isinstance(error, EngineDeadError):
        return ServerOverloadedError("the generation engine is restarting; retry shortly")
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

    def decode_many(self, refs: list) -> list:
        return self.decoder.decode_many(refs)


@serve.deployment(max_ongoing_requests=64)
class ProcessorServer:
    """Chat template + native processor: messages and decoded media to PromptInputs."""

    def __init__(self, config: ServeConfig):
        limits = PromptLimits(config.max_prompt_tokens, config.engine.max_context_len)
        self.processor = Processor(config.model_path, limits=limits)

    def media_refs(self, messages: list) -> list:
        return self.processor.media_refs(messages)

    def encode(self, messages: list, media: list, tools: list | None, template_kwargs: Any):
        return self.processor.encode(
            messages, media, tools=tools, chat_template_kwargs=template_kwargs
        )


@serve.deployment(max_ongoing_requests=4096)
class GeneratorServer:
    """One replica is one engine: a tensor-parallel group when tp_size > 1 (this replica is
    rank 0, in the first bundle of its STRICT_PACK placement group)."""

    def __init__(self, config: ServeConfig):
        self.generator = Generator.from_config(config.model_path, config.engine)

    async def generate(self, inputs, params: SamplingParams, request_id: str):
        async for output in self.generator.generate(inputs, params, request_id):
            yield output

    def stats(self) -> dict[str, int]:
        return self.generator.stats()

    def __del__(self) -> None:
        generator = getattr(self, "generator", None)
        if generator is not None:
            generator.shutdown()


api = FastAPI(title="AReno", docs_url=None, redoc_url=None)


@serve.deployment(max_ongoing_requests=4096)
@serve.ingress(api)
class Ingress:
    """`POST /v1/chat/completions`, `GET /v1/models`, `GET /health`."""

    def __init__(self, decoder, processor, generator, config: ServeConfig):
        from transformers import AutoTokenizer

        self.decoder, self.processor = decoder, processor
        self.generator = generator.options(stream=True)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.tool_parser = get_tool_parser(adapter_for_checkpoint(config.model_path).tool_format)

    @api.get("/health")
    async def health(self) -> dict:
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
        try:
            chat = parse_chat_request(await request.body())
            if chat.model is not None and chat.model != self.config.model_name:
                raise ModelNotFoundError(
                    f"model {chat.model!r} is not served here; this server serves "
                    f"{self.config.model_name!r}",
                    param="model",
                )
            params = SamplingParams.from_request(chat)
            parser = self.tool_parser if tools_in_play(chat) else None
            if parser is not None:  # tool-call tags are special tokens: keep them in the text
                params = dataclasses.replace(params, skip_special_tokens=False)
            inputs = await self._encode(chat)
            stream = self.generator.generate.remote(inputs, params, uuid.uuid4().hex)
            first = await stream.__anext__()  # request-level errors surface before any byte
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error response
            return self._error(e)
        model = self.config.model_name
        if chat.stream:
            writer = ChunkWriter(chat, model, inputs, self.tokenizer, parser)
            return StreamingResponse(
                self._sse(writer, first, stream), media_type="text/event-stream"
            )
        try:
            outputs = [first] + [output async for output in stream]
        except Exception as e:  # noqa: BLE001
            return self._error(e)
        from areno.engine.outputs import merge_outputs

        response = build_response(
            chat, model, inputs, merge_outputs(outputs), self.tokenizer, parser
        )
        return JSONResponse(response.model_dump(exclude_none=True))

    async def _encode(self, chat):
        refs = await self.processor.media_refs.remote(chat.messages)
        media = await self.decoder.decode_many.remote(refs) if refs else []
        tools = chat.tools if tools_in_play(chat) else None
        return await self.processor.encode.remote(
            chat.messages, media, tools, chat.chat_template_kwargs
        )

    async def _sse(self, writer: ChunkWriter, first, stream):
        try:
            for line in writer.chunks(first):
                yield line
            async for output in stream:
                for line in writer.chunks(output):
                    yield line
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-stream
            yield error_line(ErrorResponse.from_error(_user_error(e)).error.model_dump())
        for line in writer.end():
            yield line

    def _check_key(self, request: Request) -> JSONResponse | None:
        key = self.config.api_key
        if key is None or request.headers.get("authorization") == f"Bearer {key}":
            return None
        return self._error(
            AuthenticationError("missing or wrong API key: send 'Authorization: Bearer <key>'")
        )

    def _error(self, error: Exception) -> JSONResponse:
        user_error = _user_error(error)
        body = ErrorResponse.from_error(user_error).model_dump()
        return JSONResponse(body, status_code=user_error.status_code)
