"""The training route: an OpenAI chat endpoint in front of one rollout worker's engine, per
episode, that records every call as the engine ran it.

`areno train` has no HTTP Ingress (its rollout workers are Ray actors called by the trainer), so
an agent program's calls need an endpoint of their own. `EpisodeRoute` is that endpoint: a small
FastAPI app served by uvicorn on the rollout worker's own event loop, on loopback, at
`/episodes/<id>/v1/chat/completions` (and `/v1/models`). A request runs the serving path:
`parse_chat_request`, the worker's MediaDecoder and Processor, `prepare` and `build_response` of
areno.serve.chat (tool-call parsers, forced `tool_choice`, structured outputs, `return_token_ids`),
on the worker's Generator. Each reply is recorded in its episode (`RecordedCall`: the engine's
prompt ids, sampled ids, logprobs, policy versions), never re-tokenized from the program's text.

An episode id is a random token: a program reaches only its own episode, and a closed episode's
calls are refused (404). The run decides how tokens are sampled (its temperature, top_p, top_k
and seeds: the trainer scores the sampled tokens at that temperature), so a request that asks for
another distribution is refused (400) instead of silently sampled otherwise.
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads the routes' annotations at runtime.
import asyncio
import dataclasses
import json
import logging
import secrets
import socket
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from areno.engine.outputs import RequestOutput
from areno.engine.sampling import SamplingParams
from areno.errors import ArenoError
from areno.protocol import ChatCompletionRequest, parse_chat_request
from areno.protocol.errors import ErrorResponse, RequestValidationError, check_body_size
from areno.rollout.calls import ProgramEpisode
from areno.rollout.episode import RolloutEnv
from areno.rollout.trajectory import RecordedCall
from areno.serve.chat import PreparedChat, build_response, parse_reply, prepare, tools_in_play
from areno.serve.errors import aborted_error, user_error
from areno.serve.sampling import sampling_params

logger = logging.getLogger("areno.programs")

# The model name the route's `/v1/models` lists; a request may name any model (there is one
# policy), so a program written against `areno serve`'s model name runs unchanged.
POLICY_MODEL = "policy"
# Request fields that would change the sampled distribution away from the run's (the trainer
# scores tokens at the run's temperature): refused when set to anything but their neutral value.
_NEUTRAL = {
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
}


class EpisodeNotFoundError(ArenoError):
    """A call names no open episode (a wrong id, or its episode has ended)."""

    status_code = 404
    code = "episode_not_found"


class EpisodeCallLimitError(ArenoError):
    """An episode made more calls than `rollout.program_max_calls` allows."""

    status_code = 429
    code = "episode_call_limit"


@dataclass(frozen=True)
class RouteLimits:
    """What one call and one episode may use."""

    max_tokens_per_call: int
    max_calls: int


@dataclass
class _OpenEpisode:
    episode: ProgramEpisode
    sampling: SamplingParams  # the run's: temperature, top_p, top_k, and the episode's seed


def _failed(future: asyncio.Future) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)


class EpisodeRoute:
    """The per-episode chat endpoint of one rollout worker (the module's docstring)."""

    def __init__(self, env: RolloutEnv, limits: RouteLimits):
        self.env, self.limits = env, limits
        self._open: dict[str, _OpenEpisode] = {}
        self._server: Any = None
        self._task: asyncio.Task | None = None  # the server's
        self._starting: asyncio.Future | None = None
        self.base_url = ""

    async def start(self) -> str:
        """Serve on loopback (a free port) from the running event loop; the root URL.

        NOTE: the groups of a step (or of an evaluation) call this at once on a fresh worker:
        every caller waits for the one start, none returns before the URL is known."""
        if self._starting is None or _failed(self._starting):
            # A start that failed is tried again by the next caller, not re-raised forever.
            self._starting = asyncio.ensure_future(self._serve())
        return await asyncio.shield(self._starting)

    async def _serve(self) -> str:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(self._app(), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
            await asyncio.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.base_url

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task
            self._task = None
        self._starting = None

    def open(self, episode: ProgramEpisode, sampling: SamplingParams) -> str:
        """Record `episode`'s calls from now on; its base URL (`.../episodes/<id>/v1`)."""
        episode_id = secrets.token_hex(16)
        self._open[episode_id] = _OpenEpisode(episode, sampling)
        return f"{self.base_url}/episodes/{episode_id}/v1"

    def close(self, base_url: str) -> None:
        """Stop taking the episode's calls (a program still running gets 404)."""
        self._open.pop(base_url.rstrip("/").split("/")[-2], None)

    def _app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        @app.post("/episodes/{episode_id}/v1/chat/completions")
        async def chat_completions(episode_id: str, request: Request):
            try:
                body = await request.body()
                check_body_size(len(body))
                reply = await self.chat(episode_id, body)
            except Exception as error:  # noqa: BLE001 - every failure is an OpenAI error body
                failure = user_error(error)
                content = ErrorResponse.from_error(failure).model_dump()
                return JSONResponse(content, status_code=failure.status_code)
            return JSONResponse(reply)

        @app.get("/episodes/{episode_id}/v1/models")
        async def models(episode_id: str):
            if episode_id not in self._open:
                failure = EpisodeNotFoundError(f"no open episode {episode_id!r}")
                content = ErrorResponse.from_error(failure).model_dump()
                return JSONResponse(content, status_code=failure.status_code)
            card = {"id": POLICY_MODEL, "object": "model", "owned_by": "areno"}
            return {"object": "list", "data": [card]}

        return app

    async def chat(self, episode_id: str, body: bytes) -> dict:
        """One call of an episode: run, record, answer (the response as a JSON dict)."""
        episode = self._open.get(episode_id)
        if episode is None:
            raise EpisodeNotFoundError(
                f"no open episode {episode_id!r}: a program reaches only its own episode, and "
                "only while it runs"
            )
        request = parse_chat_request(body)
        calls = episode.episode.calls
        if len(calls) >= self.limits.max_calls:
            raise EpisodeCallLimitError(
                f"this episode made its {self.limits.max_calls} calls "
                "(rollout.program_max_calls); end the episode"
            )
        params = self._params(request, episode.sampling, len(calls))
        # NOTE: the tokenizer's work (encoding, the forced call opening, reading the reply)
        # runs on the worker's processor thread: a fast tokenizer must not be entered by two
        # threads at once.
        prepared = await self.env.processing(self._prepare, request, params)
        output = await self.env.generator.generate_all(prepared.inputs, prepared.params)
        if (aborted := aborted_error(output)) is not None:
            raise aborted  # not recorded: the program may retry the call
        reply, call = await self.env.processing(
            self._read, request, prepared, output, json.loads(body)
        )
        if episode_id in self._open:  # a call answered after its episode ended is not kept
            calls.append(call)
            episode.episode.prompts.append(prepared.inputs)
        return reply

    def _params(
        self, request: ChatCompletionRequest, run: SamplingParams, index: int
    ) -> SamplingParams:
        """The request's sampling parameters on the run's distribution, with the episode's seed
        for call `index`; refuses a request that asks for another distribution or more tokens
        than a call may sample."""
        for name, value in (("temperature", run.temperature), ("top_p", run.top_p)):
            asked = getattr(request, name)
            if asked is not None and asked != value:
                _refuse(name, f"the run samples at {name} {value} (rollout.{name}); leave it unset")
        if request.top_k is not None and request.top_k != run.top_k:
            _refuse(
                "top_k", f"the run samples at top_k {run.top_k} (rollout.top_k); leave it unset"
            )
        for name, neutral in _NEUTRAL.items():
            if getattr(request, name) not in (None, neutral):
                _refuse(name, "it changes the distribution the trainer scores; leave it unset")
        for name in ("seed", "logit_bias"):
            if getattr(request, name) is not None:
                _refuse(name, "the run decides the sampling; leave it unset")
        if request.ignore_eos:
            _refuse("ignore_eos", "it changes the distribution the trainer scores")
        if request.n != 1:
            _refuse("n", "a training call samples one reply (the run samples the group)")
        if request.stream:
            _refuse("stream", "the training route answers whole replies; leave it unset")
        limit = self.limits.max_tokens_per_call
        asked = request.max_new_tokens
        if asked is not None and asked > limit:
            _refuse(
                "max_tokens",
                f"= {asked} is over the {limit} tokens a call may sample "
                "(rollout.max_tokens_per_turn)",
            )
        seed = None if run.seed is None else run.seed + 104_729 * index
        return dataclasses.replace(
            sampling_params(request),
            temperature=run.temperature,
            top_p=run.top_p,
            top_k=run.top_k,
            seed=seed,
            max_tokens=asked or limit,
            logprobs=True,
            # The sampled distribution's logprobs: the trainer recomputes them at this temperature.
            logprobs_mode="tempered",
        )

    def _prepare(self, request: ChatCompletionRequest, params: SamplingParams) -> PreparedChat:
        """The request encoded on the one processor path (its media decoded on this worker) and
        prepared as serving prepares it."""
        env = self.env
        media = env.decoder.decode_many(env.processor.media_refs(request.messages))
        encoded = env.processor.encode(
            request.messages,
            media,
            tools=request.tools if tools_in_play(request) else None,
            chat_template_kwargs=request.chat_template_kwargs,
            max_new_tokens=params.max_tokens,
        )
        return prepare(request, params, encoded, env.parser, env.processor.tokenizer)

    def _read(
        self,
        request: ChatCompletionRequest,
        prepared: PreparedChat,
        output: RequestOutput,
        raw: dict,
    ) -> tuple[dict, RecordedCall]:
        """The reply as serving writes it (logprobs only when asked for) and the call's record."""
        sample = output.samples[0]
        shown = output
        if not request.logprobs:
            hidden = dataclasses.replace(sample, logprobs=None, top_logprobs=None)
            shown = dataclasses.replace(output, samples=[hidden])
        tokenizer = self.env.processor.tokenizer
        response, malformed = build_response(
            prepared, request.model or POLICY_MODEL, shown, tokenizer
        )
        _, parsed = parse_reply(prepared, sample.text)
        call = RecordedCall(
            prompt_ids=list(prepared.inputs.input_ids),
            token_ids=list(sample.token_ids),
            logprobs=list(sample.logprobs or [0.0] * len(sample.token_ids)),
            token_versions=list(sample.policy_versions or []),
            policy_version=output.policy_version,
            finish_reason=sample.finish_reason or "stop",
            messages=raw.get("messages", []),
            tools=raw.get("tools"),
            content=parsed.content,
            tool_calls=[
                {"name": c.function.name, "arguments": c.function.arguments}
                for c in parsed.tool_calls
            ],
            num_malformed_tool_calls=malformed,
            num_prefill_tokens=output.num_prefill_tokens,
            num_cached_tokens=output.num_cached_tokens,
        )
        return response.model_dump(exclude_none=True), call


def _refuse(field: str, why: str) -> None:
    raise RequestValidationError(f"not on the training route: {why}", param=field)
