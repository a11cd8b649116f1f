"""The Completions request (OpenAI's legacy `POST /v1/completions`, as vLLM serves it): a raw
prompt, or a batch of them, as text or token ids; no chat template.

Unlike the chat request, unknown top-level fields are refused with a 400 naming them: evaluation
harnesses talk to this endpoint, and a field the server silently ignored would change their
numbers without a word. Fields of the API that AReno does not do yet are refused the same way
(REFUSED_FIELDS). Cross-field rules read earlier fields, as in chat.py; the NOTE marks the
order they rely on.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)

from areno.protocol.chat import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    LogitBias,
    ResponseFormat,
    Stop,
    StopTokenIds,
    StreamOptions,
)
from areno.protocol.errors import (
    FieldError,
    RequestValidationError,
    load_request_body,
    validate_request,
)

# NOTE: read at validation time, so a deployment (or a test) may change it.
MAX_PROMPTS = 1024  # prompts in one request's batch

# Fields of the Completions API that this server refuses with a 400 naming them rather than
# ignore: `suffix` (insertion) is not planned.
REFUSED_FIELDS = ("suffix",)

_TokenId = Annotated[int, Field(strict=True, ge=0)]
_TokenIds = Annotated[list[_TokenId], Field(min_length=1)]


def _prompt_kind(value: Any) -> str | None:
    """The form of a `prompt`: one text, texts, one list of token ids, or lists of them."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list) or not value:
        return None
    first = value[0]
    if isinstance(first, str):
        return "texts"
    if isinstance(first, list):
        return "id_lists"
    if isinstance(first, int) and not isinstance(first, bool):
        return "ids"
    return None


def _batch_limit(value: Any) -> Any:
    if isinstance(value, list) and len(value) > MAX_PROMPTS:
        raise ValueError(f"{len(value)} prompts exceed the limit of {MAX_PROMPTS} per request")
    return value


def _not_empty(value: Any) -> Any:
    if value == []:
        raise ValueError("must not be empty")
    return value


Prompt = Annotated[
    Union[  # noqa: UP007 -- tagged unions need the runtime Union
        Annotated[str, Tag("text")],
        Annotated[list[str], BeforeValidator(_batch_limit), Tag("texts")],
        Annotated[list[_TokenId], Tag("ids")],
        Annotated[list[_TokenIds], BeforeValidator(_batch_limit), Tag("id_lists")],
    ],
    Discriminator(
        _prompt_kind,
        custom_error_type="wire_type",
        custom_error_message="Input should be a string, an array of strings, an array of token "
        "ids or an array of arrays of token ids",
    ),
    BeforeValidator(_not_empty),
]


class CompletionRequest(GenerationRequest):
    """`POST /v1/completions` body.

    `prompt` is a text (tokenized by the server, no template), a list of token ids, or a batch
    of either; choice i * n + j is sample j of prompt i. `max_tokens` is 16 when not given, as
    OpenAI's; 0 only with `echo` (score the prompt, generate nothing). `logprobs` is the number
    of alternatives per token (OpenAI allows up to 5, vLLM and AReno 20). Extensions beyond
    OpenAI, as vLLM names them: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
    `stop_token_ids`, `ignore_eos`, `response_format` (the text follows the JSON),
    `return_token_ids` (each choice's prompt ids and sampled ids). `model` is
    optional: the server answers with the model it serves. `best_of` is accepted only equal to
    `n` (every sample drawn is returned).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # NOTE: validators below read earlier fields; keep echo before max_tokens before min_tokens,
    # n before best_of and stream before stream_options.
    model: str | None = None
    prompt: Prompt
    echo: bool = False
    max_tokens: int = Field(default=16, ge=0)

    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: LogitBias | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1)

    min_tokens: int | None = Field(default=None, ge=0)
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False

    logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None

    @field_validator(
        "echo", "max_tokens", "n", "stream", "ignore_eos", "return_token_ids", mode="before"
    )
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        # Client wrappers often send `null` for "not set".
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("max_tokens")
    @classmethod
    def _nothing_to_generate_needs_echo(cls, max_tokens: int, info: ValidationInfo) -> int:
        if max_tokens == 0 and info.data.get("echo") is False:
            raise ValueError("0 (score the prompt, generate nothing) requires 'echo': true")
        return max_tokens

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n")
        if best_of is not None and n is not None and best_of != n:
            raise ValueError(
                f"must equal n ({n}) or be left out: this server returns every sample it draws "
                "and does not pick the best of more"
            )
        return best_of

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt a text or a list of token ids."""
        kind = _prompt_kind(self.prompt)
        return [self.prompt] if kind in ("text", "ids") else list(self.prompt)

    @property
    def is_batch(self) -> bool:
        """Whether `prompt` is a list of prompts (texts or token-id lists), even of one."""
        return _prompt_kind(self.prompt) in ("texts", "id_lists")

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def parse_completion_request(data: bytes | bytearray | str | dict[str, Any]) -> CompletionRequest:
    """Parse an untrusted body; every problem with it, a refused field included (REFUSED_FIELDS,
    unless null), raises `RequestValidationError`."""
    body = load_request_body(data)
    refused = [
        FieldError(name, "is not supported by this server; leave it out")
        for name in REFUSED_FIELDS
        if body.get(name) is not None
    ]
    if refused:
        raise RequestValidationError(refused)
    body = {key: value for key, value in body.items() if key not in REFUSED_FIELDS}
    return validate_request(body, CompletionRequest)
