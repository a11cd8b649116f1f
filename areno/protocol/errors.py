"""OpenAI error bodies, and turning an untrusted request body into a request or a clear 400.

`RequestValidationError` names every problem by the user's JSON path
(`messages[0].content[1].image_url.url: Field required`), not by pydantic's internal location,
which also holds union tags such as the role or part type.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from areno.errors import ArenoError
from areno.protocol.chat import ChatCompletionRequest
from areno.protocol.content import CONTENT_PART_TYPES, MESSAGE_ROLES

# NOTE: read at call time, so a deployment (or a test) may change them.
MAX_REQUEST_BYTES = 128 * 1024 * 1024  # room for inline base64 video
MAX_JSON_DEPTH = 64
# Far above what MAX_MESSAGES, MAX_PARTS_PER_REQUEST and MAX_TOOLS allow (~10^5), and far below
# what a body of MAX_REQUEST_BYTES can hold: 60 MB of `[],` parses into 20 M lists (~5 GB).
MAX_JSON_VALUES = 1_000_000
MAX_ERRORS_IN_MESSAGE = 10

RequestT = TypeVar("RequestT", bound=BaseModel)

# Location entries pydantic adds for tagged unions, which the user's JSON does not have.
_UNION_TAGS = frozenset(
    CONTENT_PART_TYPES + MESSAGE_ROLES + ("str", "list", "dict", "mode", "named")
)
_ACCEPTED_TAGS = {"type": CONTENT_PART_TYPES, "role": MESSAGE_ROLES}
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
# Each value or key of a JSON document follows one of these, outside strings.
_JSON_VALUE_MARKS = ("[", "{", ",", ":")
_JSON_OBJECT = "Input should be a JSON object"
_MESSAGE_REWRITES = {
    "model_type": _JSON_OBJECT,
    "model_attributes_type": _JSON_OBJECT,
    "dict_type": _JSON_OBJECT,
    "list_type": "Input should be a JSON array",
    "extra_forbidden": "Unknown field (not allowed in this object)",
}


class ErrorInfo(BaseModel):
    """The `error` object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """An OpenAI error body: `{"error": {...}}`."""

    error: ErrorInfo

    @classmethod
    def from_error(cls, error: ArenoError) -> ErrorResponse:
        """The body the server answers an `ArenoError` with."""
        return cls(error=ErrorInfo(**error.to_dict()))


@dataclass(frozen=True)
class FieldError:
    """One problem in a request: where (a JSON path, "" for the body itself) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or 'body'}: {self.message}"


class RequestValidationError(ArenoError):
    """The request body is not a valid request of its endpoint (HTTP 400).

    `errors` lists every problem; `param` is the path of the first. Built from a list of
    `FieldError`, or like any `ArenoError` from a message and an optional `param` path.
    """

    code = "invalid_request"

    def __init__(self, errors: list[FieldError] | str, *, param: str | None = None) -> None:
        if isinstance(errors, str):
            errors = [FieldError(param or "", errors)]
        errors = errors or [FieldError("", "invalid request")]
        shown = "; ".join(map(str, errors[:MAX_ERRORS_IN_MESSAGE]))
        if len(errors) > MAX_ERRORS_IN_MESSAGE:
            shown += f"; and {len(errors) - MAX_ERRORS_IN_MESSAGE} more"
        count = "1 error" if len(errors) == 1 else f"{len(errors)} errors"
        super().__init__(f"Invalid request ({count}): {shown}", param=errors[0].path or None)
        self.errors = errors

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild from the errors, not the formatted message (Ray pickles exceptions).
        return type(self), (self.errors,)

    @classmethod
    def from_message(cls, message: str, path: str = "") -> RequestValidationError:
        """An error about one place (the whole body when `path` is empty)."""
        return cls([FieldError(path, message)])

    @classmethod
    def from_pydantic(cls, exc: ValidationError, data: Any) -> RequestValidationError:
        """Translate `exc`, raised while validating `data`, into user JSON paths."""
        errors = [_field_error(error, data) for error in exc.errors(include_url=False)]
        return cls(list(dict.fromkeys(errors)))


class RequestTooLargeError(RequestValidationError):
    """The body is over MAX_REQUEST_BYTES, or would parse into over MAX_JSON_VALUES (HTTP 413)."""

    status_code = 413
    code = "request_too_large"


def check_body_size(num_bytes: int) -> None:
    """Refuse a body of `num_bytes` (declared or read so far) over MAX_REQUEST_BYTES."""
    if num_bytes > MAX_REQUEST_BYTES:
        raise RequestTooLargeError.from_message(
            f"the request body has {num_bytes} bytes, over the limit of {MAX_REQUEST_BYTES}"
        )


def parse_chat_request(data: bytes | bytearray | str | dict[str, Any]) -> ChatCompletionRequest:
    """Parse an untrusted body; every problem with it raises `RequestValidationError`."""
    return validate_request(load_request_body(data), ChatCompletionRequest)


def load_request_body(data: bytes | bytearray | str | dict[str, Any]) -> dict[str, Any]:
    """An untrusted body as a JSON object, held to the limits and rules above (a dict too);
    every problem with it raises `RequestValidationError`."""
    body = _load_json(data) if isinstance(data, (bytes, bytearray, str)) else data
    if not isinstance(body, dict):
        raise RequestValidationError.from_message(
            f"the request body must be a JSON object, got {_json_kind(body)}"
        )
    _check_body(body)
    return body


def validate_request(body: dict[str, Any], request_type: type[RequestT]) -> RequestT:
    """`body` (from load_request_body) as a `request_type`, its problems named by JSON path."""
    try:
        return request_type.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError.from_pydantic(exc, body) from None


def _load_json(data: bytes | bytearray | str) -> Any:
    check_body_size(len(data))
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise RequestValidationError.from_message(
                f"the request body is not valid UTF-8 (byte {exc.start})"
            ) from None
    _check_num_values(data)
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise RequestValidationError.from_message(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except ValueError as exc:  # NaN / Infinity
        raise RequestValidationError.from_message(
            f"the request body is not valid JSON: {exc}"
        ) from None
    except RecursionError:
        raise RequestValidationError.from_message(
            f"the request body nests deeper than the limit of {MAX_JSON_DEPTH}"
        ) from None


def _check_num_values(text: str) -> None:
    """Refuse, before parsing, a body that would become more than MAX_JSON_VALUES objects.

    Small bodies can expand a lot: each `[],` is 3 bytes of JSON and a 56-byte list, plus the
    time to walk it. Counting the marks that precede values is an upper bound that costs one fast
    scan; only when that bound is over the limit are strings (which may hold any mark) removed
    for the exact count.
    """
    if sum(text.count(mark) for mark in _JSON_VALUE_MARKS) <= MAX_JSON_VALUES:
        return
    structure = _JSON_STRING.sub("", text)
    num_values = sum(structure.count(mark) for mark in _JSON_VALUE_MARKS)
    if num_values > MAX_JSON_VALUES:
        raise RequestTooLargeError.from_message(
            f"the request body holds about {num_values} JSON values, over the limit of "
            f"{MAX_JSON_VALUES}; send fewer messages, content parts or tools per request"
        )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_body(body: Any) -> None:
    """Refuse what JSON cannot carry or nests absurdly, iteratively so it cannot overflow.

    A body given as a dict skipped `json.loads`, so it is held to the same rules here: no lone
    surrogates (not Unicode) and no NaN / Infinity (not JSON numbers), even in free-form fields.
    """
    stack: list[tuple[Any, tuple[Any, ...]]] = [(body, ())]
    while stack:
        node, loc = stack.pop()
        if len(loc) >= MAX_JSON_DEPTH:
            raise RequestValidationError.from_message(
                f"the request body nests deeper than the limit of {MAX_JSON_DEPTH}"
            )
        for key, child in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(child, (dict, list)):
                stack.append((child, (*loc, key)))
            elif problem := _not_json(key) or _not_json(child):
                path = _user_path((*loc, key), body, missing=False)
                raise RequestValidationError.from_message(problem, path)


def _not_json(value: Any) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a JSON number"
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "contains a lone UTF-16 surrogate, which is not Unicode text"
    return None


def _json_kind(value: Any) -> str:
    kinds = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"))
    kinds += ((list, "an array"), (type(None), "null"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _field_error(error: dict[str, Any], data: Any) -> FieldError:
    path = _user_path(error["loc"], data, missing=error["type"] == "missing")
    kind, ctx = error["type"], error.get("ctx") or {}
    message = _MESSAGE_REWRITES.get(kind, error["msg"]).removeprefix("Value error, ")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        key = str(ctx.get("discriminator", "")).strip("'")
        accepted = ", ".join(map(repr, _ACCEPTED_TAGS.get(key, ())))
        found = (
            f"unknown {key} {ctx.get('tag')!r}" if kind == "union_tag_invalid" else "Field required"
        )
        path, message = _join(path, key), f"{found}; expected one of: {accepted}"
    return FieldError(path, message)


def _user_path(loc: tuple[Any, ...], data: Any, *, missing: bool) -> str:
    """Follow `loc` through the user's JSON, keeping only the steps that exist in it."""
    path, node = "", data
    for i, key in enumerate(loc):
        is_last = i == len(loc) - 1
        if not _resolves(node, key):
            if is_last and missing and isinstance(node, dict):
                path = _join(path, key)  # the absent field itself
            continue  # a union tag or another pydantic-only step
        if key in _UNION_TAGS and not is_last and _resolves(node, loc[i + 1]):
            continue  # a tag that is also a key here; the real step comes right after it
        path, node = _join(path, key), node[key]
    return path


def _resolves(node: Any, key: Any) -> bool:
    if isinstance(node, dict):
        return key in node
    return isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node)


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if not _IDENTIFIER.match(str(key)):
        return f"{path}[{json.dumps(str(key))}]"
    return f"{path}.{key}" if path else str(key)
