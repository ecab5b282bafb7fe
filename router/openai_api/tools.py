"""A chat request's tools: checked, handed to the chat template, and forced by a grammar when asked.

``tools`` (OpenAI's ``[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]``)
go to the chat template as transformers' ``apply_chat_template(tools=...)`` passes them. ``tool_choice``:

=============================== ===================================================================
``none``                        no call: the text is the answer (the template still sees the tools)
``auto`` (default with tools)   the model decides; calls are parsed out of its text (`tool_parsers`)
``required``                    at least one call (one with ``parallel_tool_calls: false``), to any of
                                the tools: a grammar forces the model family's call syntax, each
                                call's arguments matching its tool's ``parameters`` schema
``{"type": "function",          a call to that function (forced the same way)
"function": {"name": ...}}``
=============================== ===================================================================

A forced choice cannot be combined with ``response_format`` / ``guided_*`` (both would constrain the same
text), and needs a tool-call format (``model.tool_parser`` not ``none``), as ``auto`` does.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.sampling.structured import StructuredOutput
from router.openai_api.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from router.openai_api.structured import check_spec, requested_fields
from router.openai_api.tool_parsers import ToolCallParser, ToolFormat
from router.validation import invalid

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(slots=True)
class ToolRequest:
    """What a chat request asked of its tools.

    Attributes:
        tools: the tool definitions as the template receives them.
        choice: "none" | "auto" | "required" | "function" (one named function).
        names: the offered functions' names (``choice`` "function": that one only).
        format: the model family's call syntax (None: ``model.tool_parser`` is none).
        forced: the grammar of a required or named call, else None.
    """

    tools: list[dict]
    choice: str
    names: list[str]
    format: ToolFormat | None
    forced: StructuredOutput | None = None

    def parser(self) -> ToolCallParser | None:
        """A fresh parser for one sequence's text, or None when the text is the answer (choice none)."""
        if self.choice == "none" or self.format is None:
            return None
        return self.format.parser(self.names)


def tool_request(body: ChatCompletionRequest, fmt: ToolFormat | None) -> ToolRequest | None:
    """The request's tools, checked (None without tools).

    Raises:
        RequestError: INVALID_ARGUMENT naming ``tools`` or ``tool_choice``: a bad or repeated name, an unknown
            named function, a forced choice with a structured-output field or without a tool-call format,
            a forced tool's ``parameters`` that the grammar cannot express.
    """
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice: set tools to choose among them", "tool_choice")
        return None
    names = []
    for i, tool in enumerate(body.tools):
        name = tool.function.name
        if not NAME.fullmatch(name):
            raise invalid(f"tools[{i}].function.name: {name!r} must be 1-64 letters, digits, '_' or '-'", "tools")
        if name in names:
            raise invalid(f"tools[{i}].function.name: {name!r} is offered twice", "tools")
        names.append(name)
    kind = "auto" if choice is None else "function" if isinstance(choice, NamedToolChoice) else choice
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    out = ToolRequest(tools, kind, names, fmt)
    if kind == "none":
        return out
    if fmt is None:
        raise invalid("tools: this server parses no tool calls (model.tool_parser: none); send tool_choice "
                      "\"none\" or no tools", "tool_choice" if choice is not None else "tools")
    if kind == "auto":
        return out
    if kind == "function":
        if choice.function.name not in names:
            raise invalid(f"tool_choice.function.name: {choice.function.name!r} is not among the tools "
                          f"({', '.join(names)})", "tool_choice")
        out.names = [choice.function.name]
    fields = requested_fields(body)
    if fields:
        raise invalid(f"tool_choice {kind if kind != 'function' else 'naming a function'} forces a tool call; it "
                      f"cannot be combined with {', '.join(fields)}", "tool_choice")
    forced = []
    for i, tool in enumerate(body.tools):
        if tool.function.name in out.names:
            parameters = tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS
            check_spec(StructuredOutput(json_schema=json.dumps(parameters)), f"tools[{i}].function.parameters",
                       "tools")
            forced.append((tool.function.name, parameters))
    out.forced = StructuredOutput(grammar=fmt.grammar(forced, parallel=body.parallel_tool_calls is not False))
    check_spec(out.forced, "tools", "tools")
    return out


def template_tool_calls(message: ChatMessage, index: int) -> list[dict]:
    """An assistant message's calls as chat templates read them: ``arguments`` as an object when it is one
    (templates write it with ``tojson``), else the text as sent.

    Raises:
        RequestError: INVALID_ARGUMENT naming ``messages``: calls on a message that is not the assistant's.
    """
    if message.role != "assistant":
        raise invalid(f"messages[{index}].tool_calls: only assistant messages carry tool calls", "messages")
    out = []
    for call in message.tool_calls:
        try:
            arguments = json.loads(call.function.arguments)
        except (ValueError, RecursionError):        # not JSON, or nested deeper than the decoder goes
            arguments = call.function.arguments
        if not isinstance(arguments, dict):
            arguments = call.function.arguments
        out.append({"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                     "arguments": arguments}})
    return out
