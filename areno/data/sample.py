"""A training sample: the prompt the policy sees, and the private data only the reward reads.

`Sample.messages` are Chat Completions messages exactly as the serving API takes them, validated
by the serving layer's own validator, so a sample that loads is a sample the engine can run.
`Sample.private` holds reference answers and anything else the reward function alone may read.

NOTE: only `Sample.public()` may cross to rollout workers, tool environments or logs. `repr` and
`str` redact private values, but `dataclasses.asdict`, `vars` and pickling do not: they are for
moving the whole sample to the reward side, never for logging.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from areno.errors import ArenoError
from areno.processing.messages import validate_messages
from areno.protocol import RequestValidationError, ToolDefinition

REDACTED = "<redacted>"
_JSON_KEYS = ("id", "messages", "tools", "private")
_MAX_ERRORS_SHOWN = 5


class _Tools(BaseModel):
    tools: list[ToolDefinition]


class SampleError(ArenoError):
    """A sample (or a line of a dataset file) is malformed; the message says which and why."""

    code = "invalid_sample"


@dataclass(frozen=True)
class PublicSample:
    """What of a sample may leave the trainer: id, messages and tools, deep-copied."""

    id: str | None
    messages: list[dict]
    tools: list[dict] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (deep-copied)."""
        return copy.deepcopy({"id": self.id, "messages": self.messages, "tools": self.tools})


@dataclass(repr=False)
class Sample:
    """One prompt with its private reward data.

    Args:
        messages: OpenAI chat messages (dicts), as the serving API takes them.
        tools: OpenAI tool definitions the model may call, or None.
        private: reference answers and other data only the reward function may read.
        id: a stable identifier, used in error messages and logs.

    Raises:
        SampleError: a field is malformed; the message names the sample id and the JSON path.
    """

    messages: list[dict]
    tools: list[dict] | None = None
    private: dict = field(default_factory=dict)
    id: str | None = None

    def __post_init__(self) -> None:
        if self.id is not None and not isinstance(self.id, str):
            raise SampleError(f"sample id must be a string or None, got {type(self.id).__name__}")
        if not isinstance(self.private, dict):
            raise self._error(f"private must be a dict, got {type(self.private).__name__}")
        self._check_messages()
        self._check_tools()

    def _error(self, message: str, param: str | None = None) -> SampleError:
        name = "sample (no id)" if self.id is None else f"sample {self.id!r}"
        return SampleError(f"{name}: {message}", param=param)

    def _check_messages(self) -> None:
        if not isinstance(self.messages, list) or not self.messages:
            kind = type(self.messages).__name__
            raise self._error(f"messages must be a non-empty list of message dicts, got {kind}")
        if bad := [i for i, m in enumerate(self.messages) if not isinstance(m, dict)]:
            kind = type(self.messages[bad[0]]).__name__
            raise self._error(
                f"messages[{bad[0]}] must be a dict, got {kind}", f"messages[{bad[0]}]"
            )
        try:
            validate_messages(self.messages)
        except RequestValidationError as e:
            raise self._error(_field_errors(e), e.param) from None

    def _check_tools(self) -> None:
        if self.tools is None:
            return
        if not isinstance(self.tools, list):
            raise self._error(f"tools must be a list or None, got {type(self.tools).__name__}")
        body = {"tools": self.tools}
        try:
            _Tools.model_validate(body)
        except ValidationError as e:
            error = RequestValidationError.from_pydantic(e, body)
            raise self._error(_field_errors(error), error.param) from None

    def public(self) -> PublicSample:
        """The part that may be sent to rollout workers, tool environments and logs."""
        return PublicSample(
            id=self.id, messages=copy.deepcopy(self.messages), tools=copy.deepcopy(self.tools)
        )

    def __repr__(self) -> str:
        private = {key: REDACTED for key in self.private}
        return (
            f"Sample(id={self.id!r}, messages={self.messages!r}, tools={self.tools!r}, "
            f"private={private!r})"
        )

    __str__ = __repr__

    def to_dict(self) -> dict[str, Any]:
        """Every field, private included, as one dict (deep-copied). Not for logging."""
        return copy.deepcopy(
            {"id": self.id, "messages": self.messages, "tools": self.tools, "private": self.private}
        )

    def to_json(self) -> str:
        """One JSONL line (no trailing newline), private included."""
        try:
            return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise self._error(f"cannot be written as JSON: {e}") from None

    @classmethod
    def from_dict(cls, data: Any) -> Sample:
        """The inverse of `to_dict`; unknown keys are refused (a misspelt "private" would drop
        the reference answers silently)."""
        if not isinstance(data, dict):
            raise SampleError(f"a sample must be a JSON object, got {type(data).__name__}")
        if unknown := sorted(set(data) - set(_JSON_KEYS)):
            raise SampleError(
                f"unknown sample field(s) {', '.join(map(repr, unknown))}; "
                f"expected only {', '.join(map(repr, _JSON_KEYS))}"
            )
        if "messages" not in data:
            raise SampleError("a sample needs a 'messages' field")
        private = {} if data.get("private") is None else data["private"]
        return cls(
            messages=data["messages"], tools=data.get("tools"), private=private, id=data.get("id")
        )

    @classmethod
    def from_json(cls, line: str | bytes) -> Sample:
        """Parse one JSONL line written by `to_json` (or by hand, in the same format)."""
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise SampleError(f"not valid JSON: {e.msg} at column {e.colno}") from None
        return cls.from_dict(data)


def _field_errors(error: RequestValidationError) -> str:
    # Not `error.message`: its "Invalid request (...)" opening reads wrongly for a dataset.
    shown = "; ".join(map(str, error.errors[:_MAX_ERRORS_SHOWN]))
    more = len(error.errors) - _MAX_ERRORS_SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")
