"""The grammar a Chat Completions request's reply must follow, as the engine's StructuredOutput.

- `response_format` json_object / json_schema: the reply is that JSON.
- Tool calls in the family's own syntax (`ToolParser.call_opening`, arguments in its
  `argument_style`, `call_closing`), arguments constrained to the tool's JSON Schema:
  - tool_choice "required" or named: the reply is calls only. The prompt already ends with the
    forced call opening (serve/chat.py), so the grammar starts after it. A named call whose
    only freedom is one listed value (`areno.tools.choice_call`): the reply is that value's
    telling part alone; the server writes the rest of the call around it.
  - tool_choice "auto" with `strict` tools, or `parallel_tool_calls: false`: free text in which
    every call that starts must be well formed (a strict tool's arguments follow its schema,
    another tool's are any object), and with parallel calls off nothing follows the first call.
- A reply that starts inside a reasoning block (serve/chat.py, `thinking`) may reason freely up
  to the block's end tag; the grammar applies after it.

Specs are xgrammar structural tags written as plain JSON, compiled by the engine
(areno/engine/outputs/grammar.py), which caches them: the same tools give the same spec text.
"""

from __future__ import annotations

import json
from typing import Any

from areno.engine.sampling import StructuredOutput
from areno.protocol import ChatCompletionRequest
from areno.protocol.chat import NamedToolChoice, ResponseFormat, check_enforceable
from areno.protocol.errors import RequestValidationError
from areno.tools import ChoiceCall, ToolParser
from areno.tools.reasoning import THINK_END

# Whitespace a constrained value may hold in a row. A JSON reply: enough for indented JSON, not
# enough for a model to pad it until max_tokens. A call's arguments: the layout the templates
# write (`", "`, `": "`, one newline around an XML value), no more.
MAX_WHITESPACE = 16
MAX_ARGUMENT_WHITESPACE = {"json": 2}
DEFAULT_ARGUMENT_WHITESPACE = 1
ANY_OBJECT = {"type": "object"}
# Keywords a call syntax's grammar drops beyond those every grammar drops (protocol/chat.py,
# UNENFORCED_KEYWORDS). xgrammar's gemma style keeps Gemma 4's `<|"|>` delimiter out of a
# string by a filter, and ignores the string's length bounds with it (it warns): a strict call
# came back longer than its maxLength.
STYLE_UNENFORCED = {"gemma": ("minLength", "maxLength")}


def structured_output(
    request: ChatCompletionRequest,
    parser: ToolParser | None,
    prefix: str,
    thinking: bool,
    choice: ChoiceCall | None = None,
) -> StructuredOutput | None:
    """The grammar of the request's reply (None: free text). `parser` is None unless tools are
    in play; `prefix` is the forced call opening the prompt ends with ("" when none); `choice`
    the forced choice whose value is the whole reply (None when the call is not one)."""
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if parser is not None:
            raise RequestValidationError(
                "a JSON response_format cannot be combined with tools the model may call; send "
                "tool_choice 'none', or constrain the calls with strict tools instead",
                param="response_format",
            )
        return json_output(response_format, thinking)
    if parser is None:
        return None
    if choice is not None:
        values = [{"type": "const_string", "value": c} for c in choice.choices]
        return _structural(_one_of(values), False, "tools")
    calls = _tool_calls(request, parser, prefix)
    return None if calls is None else _structural(calls, thinking, "tools")


def json_output(
    response_format: ResponseFormat | None, thinking: bool = False
) -> StructuredOutput | None:
    """The grammar of a JSON `response_format` (None for text or none), after free reasoning
    with `thinking`."""
    if response_format is None or response_format.type == "text":
        return None
    schema = ANY_OBJECT
    if response_format.type == "json_schema":
        schema = response_format.json_schema.schema_
    if thinking:
        return _structural(_json(schema), thinking, "response_format")
    if response_format.type == "json_object":
        return StructuredOutput("json_object", param="response_format")
    return StructuredOutput("json_schema", json.dumps(schema), param="response_format")


def _structural(body: dict, thinking: bool, param: str) -> StructuredOutput:
    """`body` as a structural tag, after free reasoning up to its end tag with `thinking`."""
    if thinking:
        reasoning = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": THINK_END}
        body = {"type": "sequence", "elements": [reasoning, _whitespace(), body]}
    spec = {"type": "structural_tag", "format": body}
    return StructuredOutput("structural_tag", json.dumps(spec, sort_keys=True), param=param)


def _tool_calls(request: ChatCompletionRequest, parser: ToolParser, prefix: str) -> dict | None:
    tools = {tool.function.name: tool.function for tool in request.tools or ()}
    choice = request.tool_choice
    parallel = request.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice) or choice == "required":
        # Every argument is constrained, strict or not: the call is the whole reply.
        schemas = {name: _schema(fn.parameters, name, parser) for name, fn in tools.items()}
        names = [choice.function.name] if isinstance(choice, NamedToolChoice) else list(schemas)
        first = _one_of([_call(parser, n, schemas[n], skip=len(prefix)) for n in names])
        if isinstance(choice, NamedToolChoice) or not parallel:
            return first
        more = {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}]}
        more["elements"].append(_one_of([_call(parser, n, s) for n, s in schemas.items()]))
        return {"type": "sequence", "elements": [first, {"type": "star", "content": more}]}
    if not parallel or any(fn.strict for fn in tools.values()):
        tags = [
            {
                "type": "tag",
                "begin": parser.call_opening(name),
                "content": _arguments(
                    parser, _schema(fn.parameters, name, parser) if fn.strict else ANY_OBJECT
                ),
                "end": parser.call_closing,
            }
            for name, fn in tools.items()
        ]
        return {
            "type": "triggered_tags",
            "triggers": [parser.start_tag],
            "tags": tags,
            "stop_after_first": not parallel,
        }
    return None


def _schema(parameters: dict[str, Any] | None, name: str, parser: ToolParser) -> dict[str, Any]:
    """A tool's parameter schema, refused (400 naming the tool) where the grammar of the
    family's call syntax cannot enforce it; a tool without parameters takes an empty object."""
    if parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    try:
        also = STYLE_UNENFORCED.get(parser.argument_style, ())
        return check_enforceable(parameters, "parameters", also)
    except ValueError as error:
        raise RequestValidationError(
            f"tool {name!r}: its parameters {error}", param="tools"
        ) from None


def _call(parser: ToolParser, name: str, schema: dict, skip: int = 0) -> dict:
    """One whole call of `name`, less its first `skip` characters (the forced prefix)."""
    opening = parser.call_opening(name)[skip:]
    elements = [{"type": "const_string", "value": opening}] if opening else []
    elements.append(_arguments(parser, schema))
    elements.append({"type": "const_string", "value": parser.call_closing})
    return {"type": "sequence", "elements": elements}


def _arguments(parser: ToolParser, schema: dict) -> dict:
    style = parser.argument_style
    whitespace = MAX_ARGUMENT_WHITESPACE.get(style, DEFAULT_ARGUMENT_WHITESPACE)
    return _json(schema) | {"style": style, "max_whitespace_cnt": whitespace}


def _json(schema: dict | bool) -> dict:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def _one_of(formats: list[dict]) -> dict:
    return formats[0] if len(formats) == 1 else {"type": "or", "elements": formats}


def _whitespace() -> dict:
    return {"type": "regex", "pattern": r"\s{0,4}"}
