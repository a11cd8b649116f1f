"""Completions (OpenAI's legacy API) on top of the engine: prompts, responses, stream chunks,
logprobs, usage.

A request is a batch of prompts, each run as its own Generator request of n samples; choice
i * n + j is sample j of prompt i. `echo` puts each prompt's text before its choices' text and,
with `logprobs`, its tokens' logprobs (from `Generator.score`) before theirs. Pure functions of
the request, its prompts, the scores and the Generator's `RequestOutput`s, so the HTTP layer
(ingress.py) stays thin and these are unit-testable without Ray.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from areno.engine.outputs import RequestOutput, SampleDelta, TokenScores
from areno.engine.sampling import SamplingParams
from areno.errors import PromptTooLongError
from areno.processing.encode import PromptLimits
from areno.processing.types import PromptInputs
from areno.protocol import CompletionRequest, RequestValidationError
from areno.protocol.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)


@dataclasses.dataclass(frozen=True)
class CompletionPrompt:
    """One prompt of the batch: the tokens the engine runs, the text an echo repeats."""

    inputs: PromptInputs
    text: str


@dataclasses.dataclass(frozen=True)
class PreparedCompletion:
    """A request as the Generator runs it and as its reply is read: `params` is None when it
    generates nothing (max_tokens 0: the prompts are only scored); `adapter` is the LoRA
    adapter its `model` names (None: the base model)."""

    request: CompletionRequest
    params: SamplingParams | None
    prompts: list[CompletionPrompt]
    adapter: str | None = None

    @property
    def scores_prompts(self) -> bool:
        """Whether the prompts' logprobs are asked for (`echo` with `logprobs`)."""
        return self.request.echo and self.request.logprobs is not None

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.request.n + sample_index


def encode_prompts(
    request: CompletionRequest, tokenizer: Any, limits: PromptLimits
) -> list[CompletionPrompt]:
    """Each prompt of the batch as tokens: a text tokenized as it is (no chat template, the
    tokenizer's own special tokens added, as vLLM does), token ids checked against the
    vocabulary; each held to the same limits as a chat prompt. Raises RequestValidationError or
    PromptTooLongError naming the prompt."""
    prompts = []
    for i, prompt in enumerate(request.prompts):
        path = f"prompt[{i}]" if request.is_batch else "prompt"
        if isinstance(prompt, str):
            token_ids, text = tokenizer(prompt)["input_ids"], prompt
        else:
            _check_vocabulary(prompt, len(tokenizer), path)
            token_ids, text = list(prompt), tokenizer.decode(prompt)
        if not token_ids:
            raise RequestValidationError.from_message(
                "encodes to no tokens; send at least one", path
            )
        try:
            limits.check(len(token_ids), request.max_tokens or None)
        except PromptTooLongError as error:
            where = f"{path}: " if request.is_batch else ""
            raise PromptTooLongError(where + error.message, param=path) from None
        prompts.append(CompletionPrompt(PromptInputs(token_ids, {}, prompt_text=text), text))
    return prompts


def _check_vocabulary(token_ids: Sequence[int], vocab_size: int, path: str) -> None:
    for j, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            raise RequestValidationError.from_message(
                f"token id {token_id} is not in the vocabulary (ids 0 to {vocab_size - 1})",
                f"{path}[{j}]",
            )


class _LogprobsReader:
    """Completions logprobs of token ids, their strings decoded one token at a time."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def read(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float | None],
        top_logprobs: Sequence[Sequence[tuple[int, float]] | None],
        offset: int,
    ) -> CompletionLogprobs:
        """`offset`: where the first token's text starts in the choice's text."""
        tokens = [self.tokenizer.decode([token_id]) for token_id in token_ids]
        lengths = [len(token) for token in tokens[:-1]]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=list(logprobs),
            top_logprobs=[self._alternatives(top) for top in top_logprobs],
            text_offset=list(itertools.accumulate(lengths, initial=offset)) if tokens else [],
        )

    def _alternatives(self, top: Sequence[tuple[int, float]] | None) -> dict[str, float] | None:
        if top is None:
            return None
        alternatives: dict[str, float] = {}
        for token_id, logprob in top:  # most likely first: it keeps a string two ids decode to
            alternatives.setdefault(self.tokenizer.decode([token_id]), logprob)
        return alternatives

    def prompt(self, inputs: PromptInputs, scores: TokenScores) -> CompletionLogprobs:
        """An echoed prompt's logprobs: the first token has none (None), as OpenAI's."""
        top = scores.top_logprobs or [[] for _ in scores.logprobs]
        return self.read(inputs.input_ids, [None, *scores.logprobs], [None, *top], 0)

    def sample(self, delta: SampleDelta, offset: int) -> CompletionLogprobs:
        top = delta.top_logprobs or [[] for _ in delta.token_ids]
        return self.read(delta.token_ids, delta.logprobs or [], top, offset)


def usage_for(
    prepared: PreparedCompletion, num_completion_tokens: int, num_cached_tokens: int = 0
) -> Usage:
    """Each prompt's tokens count once, however many samples it has (as OpenAI counts); the
    prompt tokens the prefix cache held are `prompt_tokens_details.cached_tokens` where any."""
    num_prompt = sum(p.inputs.num_prompt_tokens for p in prepared.prompts)
    details = PromptTokensDetails(cached_tokens=num_cached_tokens) if num_cached_tokens else None
    return Usage.from_counts(num_prompt, num_completion_tokens, details)


def build_completion_response(
    prepared: PreparedCompletion,
    model: str,
    scores: Sequence[TokenScores | None],
    outputs: Sequence[RequestOutput | None],
    tokenizer: Any,
) -> CompletionResponse:
    """The non-streaming response from each prompt's scores (None unless scores_prompts) and
    merged output (one delta per sample; None when nothing is generated)."""
    reader = _LogprobsReader(tokenizer)
    choices, num_completion = [], 0
    for i, (prompt, output) in enumerate(zip(prepared.prompts, outputs, strict=True)):
        echo_text, echo_logprobs = _echo(prepared, prompt, scores[i], reader)
        ids = _prompt_ids(prepared, prompt)
        if output is None:  # max_tokens 0: the limit is reached at once
            choices += [
                CompletionChoice(
                    index=prepared.choice_index(i, j),
                    text=echo_text,
                    logprobs=echo_logprobs,
                    finish_reason="length",
                    prompt_token_ids=ids,
                    token_ids=[] if ids is not None else None,
                )
                for j in range(prepared.request.n)
            ]
            continue
        for delta in output.samples:
            num_completion += len(delta.token_ids)
            logprobs = None
            if prepared.request.logprobs is not None:
                logprobs = _join(echo_logprobs, reader.sample(delta, len(echo_text)))
            choices.append(
                CompletionChoice(
                    index=prepared.choice_index(i, delta.index),
                    text=echo_text + delta.text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason or "stop",
                    prompt_token_ids=ids,
                    token_ids=list(delta.token_ids) if ids is not None else None,
                )
            )
    num_cached = sum(output.num_cached_tokens for output in outputs if output is not None)
    usage = usage_for(prepared, num_completion, num_cached)
    return CompletionResponse(model=model, choices=choices, usage=usage)


def _prompt_ids(prepared: PreparedCompletion, prompt: CompletionPrompt) -> list[int] | None:
    """A prompt's ids as the engine ran them, where the request asks (`return_token_ids`)."""
    return list(prompt.inputs.input_ids) if prepared.request.return_token_ids else None


def _echo(
    prepared: PreparedCompletion,
    prompt: CompletionPrompt,
    score: TokenScores | None,
    reader: _LogprobsReader,
) -> tuple[str, CompletionLogprobs | None]:
    """What each choice of `prompt` starts with: with `echo` its text and (when scored) its
    tokens' logprobs; else nothing."""
    if not prepared.request.echo:
        return "", None
    return prompt.text, reader.prompt(prompt.inputs, score) if score is not None else None


def _join(first: CompletionLogprobs | None, second: CompletionLogprobs) -> CompletionLogprobs:
    if first is None:
        return second
    return CompletionLogprobs(
        **{name: getattr(first, name) + getattr(second, name) for name in second.model_fields}
    )


class CompletionChunkWriter:
    """Turns a request's scores and its prompts' streams of deltas into SSE lines of
    `text_completion` chunks: each echoed choice's prompt first (`echo`), then the deltas as
    they come, then the usage chunk (when asked for) and `[DONE]`."""

    def __init__(
        self,
        prepared: PreparedCompletion,
        model: str,
        scores: Sequence[TokenScores | None],
        tokenizer: Any,
    ):
        self.prepared, self.model, self.scores = prepared, model, scores
        self.reader = _LogprobsReader(tokenizer)
        self.id = CompletionResponse(model=model).id
        self.num_completion_tokens = 0
        self._cached: dict[int, int] = {}  # prompt index -> its tokens the prefix cache held
        self._texts: dict[int, str] = {}  # choice index -> its text so far
        self._finish_reasons: dict[int, str] = {}
        self._sent_prompt_ids: set[int] = set()  # choices whose prompt ids were sent

    def start(self) -> Iterator[str]:
        """Each choice's echoed prompt (finished at once when nothing is generated)."""
        if not self.prepared.request.echo:
            return
        finish = "length" if self.prepared.params is None else None
        for i, prompt in enumerate(self.prepared.prompts):
            text, logprobs = _echo(self.prepared, prompt, self.scores[i], self.reader)
            choices = []
            for j in range(self.prepared.request.n):
                index = self.prepared.choice_index(i, j)
                self._texts[index] = text
                if finish is not None:
                    self._finish_reasons[index] = finish
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=finish,
                        **self._first_ids(index, prompt),
                    )
                )
            yield self._line(choices)

    def chunks(self, prompt_index: int, output: RequestOutput) -> Iterator[str]:
        """SSE lines for one step's deltas of prompt `prompt_index`."""
        self._cached[prompt_index] = max(
            self._cached.get(prompt_index, 0), output.num_cached_tokens
        )
        choices = []
        for delta in output.samples:
            self.num_completion_tokens += len(delta.token_ids)
            finish = delta.finish_reason  # an aborted request is an error, never here
            if not (delta.text or delta.token_ids or finish):
                continue
            index = self.prepared.choice_index(prompt_index, delta.index)
            ids = self._first_ids(index, self.prepared.prompts[prompt_index])
            if self.prepared.request.return_token_ids:
                ids["token_ids"] = list(delta.token_ids)
            offset = len(self._texts.get(index, ""))
            self._texts[index] = self._texts.get(index, "") + delta.text
            if finish is not None:
                self._finish_reasons[index] = finish
            logprobs = None
            if self.prepared.request.logprobs is not None:
                logprobs = self.reader.sample(delta, offset)
            choices.append(
                CompletionChoice(
                    index=index, text=delta.text, logprobs=logprobs, finish_reason=finish, **ids
                )
            )
        if choices:
            yield self._line(choices)

    def _first_ids(self, index: int, prompt: CompletionPrompt) -> dict[str, list[int]]:
        """`prompt_token_ids` for choice `index`'s first chunk (`return_token_ids`)."""
        ids = _prompt_ids(self.prepared, prompt)
        if ids is None or index in self._sent_prompt_ids:
            return {}
        self._sent_prompt_ids.add(index)
        return {"prompt_token_ids": ids}

    def end(self) -> Iterator[str]:
        """The usage chunk (when asked for) and `[DONE]`."""
        if self.prepared.request.include_usage:
            usage = usage_for(self.prepared, self.num_completion_tokens, sum(self._cached.values()))
            chunk = CompletionResponse(id=self.id, model=self.model, usage=usage)
            yield f"data: {chunk.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    def summary(self) -> dict:
        """What was streamed, as the body of the same non-streaming reply without logprobs
        (for metrics and the completion log)."""
        choices = [
            {"index": i, "text": text, "finish_reason": self._finish_reasons.get(i)}
            for i, text in sorted(self._texts.items())
        ]
        usage = usage_for(self.prepared, self.num_completion_tokens, sum(self._cached.values()))
        return {"id": self.id, "choices": choices, "usage": usage.model_dump()}

    def _line(self, choices: list[CompletionChoice]) -> str:
        chunk = CompletionResponse(id=self.id, model=self.model, choices=choices)
        return f"data: {chunk.model_dump_json()}\n\n"
