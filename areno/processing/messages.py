"""Turn Chat Completions messages into what a checkpoint's chat template renders.

Media parts become bare `{"type": <modality>}` items (the template writes the family's placeholder
token; the processor expands it), and the references are collected in order for the decoder.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from areno.media.types import MediaRef
from areno.protocol import ChatMessage, RequestValidationError, iter_media_parts


class _Messages(BaseModel):
    messages: list[ChatMessage]


def validate_messages(messages: Sequence[Any]) -> list[ChatMessage]:
    """Accept protocol messages or plain dicts in the serving format (dataset loaders yield dicts)."""
    if all(isinstance(m, BaseModel) for m in messages):
        return list(messages)
    body = {"messages": [m.model_dump() if isinstance(m, BaseModel) else m for m in messages]}
    try:
        return _Messages.model_validate(body).messages
    except ValidationError as e:
        raise RequestValidationError.from_pydantic(e, body) from None


def _render_part(part: Any) -> dict:
    if part.type == "text":
        return {"type": "text", "text": part.text}
    return {"type": part.modality}


def _render_content(content: Any) -> str | list[dict] | None:
    if content is None or isinstance(content, str):
        return content
    return [_render_part(p) for p in content]


def _arguments(raw: Any) -> Any:
    # Templates render arguments as a mapping; the wire format carries a JSON string.
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _render_tool_calls(calls: Sequence[Any] | None) -> list[dict] | None:
    if not calls:
        return None
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
        }
        for c in calls
    ]


def to_template_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """Messages in the shape Hugging Face chat templates expect, media reduced to placeholders."""
    out = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": _render_content(m.content)}
        if getattr(m, "tool_calls", None):
            item["tool_calls"] = _render_tool_calls(m.tool_calls)
        for key in ("reasoning_content", "tool_call_id", "name"):
            value = getattr(m, key, None)
            if value is not None:
                item[key] = value
        out.append(item)
    return out


def media_refs(messages: Sequence[ChatMessage]) -> list[MediaRef]:
    """Every media reference in the messages, in the order the template renders them."""
    return [
        MediaRef(modality=part.modality, url=part.media_url, options=part.media_options)
        for _, part in iter_media_parts(messages)
    ]


def tools_as_dicts(tools: Sequence[Any] | None) -> list[dict] | None:
    if not tools:
        return None
    return [t if isinstance(t, dict) else t.model_dump(exclude_none=True) for t in tools]
