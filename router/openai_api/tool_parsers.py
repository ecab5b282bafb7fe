"""Tool-call formats of model families: the grammar that forces a call, and the parser that finds calls in text.

=============== ============================================================== ==========================
format          what the model writes                                           calls in parallel
=============== ============================================================== ==========================
``hermes``      ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` one block after another,
                (Hermes 2 Pro, Qwen2.5 / Qwen3, the default ChatML template)    ``\\n`` between
``llama3_json`` ``{"name": "f", "parameters": {...}}`` as the whole reply        ``; `` between
                (Llama 3.1 / 3.2 / 3.3 JSON tool calling; a leading
                ``<|python_tag|>`` is allowed)
=============== ============================================================== ==========================

`tool_format` picks one: ``model.tool_parser`` names it, or ``auto`` reads the chat template (``<tool_call>``:
hermes; ``<|python_tag|>`` or Llama's ``"parameters": dictionary`` instruction: llama3_json; else hermes).

`ToolFormat.grammar` is the Lark grammar (llguidance) that forces one call, or one or more, each to a
named tool with its ``parameters`` schema as the arguments' schema, in ``json.dumps``' spacing:
``tool_choice`` ``required`` (any of the tools) and a named function use it. `ToolFormat.parser` returns
a `ToolCallParser`: fed the generated text piece by piece, it sends on plain text at once, but holds back
what may be the start of a call (a partial ``<tool_call>``, the whitespace before it), so no markup
reaches the client; a call's name goes out as soon as it is complete, then its arguments as the model
writes them. A whole response is the same parser fed the whole text at once, so streamed and whole
answers carry the same calls.

Arguments are the JSON text the model wrote for them (leading blanks dropped). Content is the text
outside calls, without the whitespace that borders a call; a call to a function the request did not
offer, or a block that is not a call, stays in the content as written.
"""
from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

TOOL_PARSERS = ("auto", "hermes", "llama3_json", "none")
# A forced call is written as `json.dumps` writes JSON (", " and ": ", no other blanks): as chat templates
# render earlier calls (``tojson``), so the model continues in the format it was shown.
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# {"name": "<name>", "arguments": — the head of a call whose name comes first ("parameters" too)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:')


def new_call_id() -> str:
    """OpenAI's shape: ``call_`` + 24 random characters."""
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ToolCall:
    """One call found in the text: ``arguments`` is JSON text."""

    name: str
    arguments: str = ""
    id: str = field(default_factory=new_call_id)

    def json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolCallDelta:
    """What a call gained in one piece of text: its first delta has ``id`` and ``name``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def json(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            out["function"] = {"name": self.name, "arguments": self.arguments}
        else:
            out["function"] = {"arguments": self.arguments}
        return out


@dataclass(slots=True)
class Parsed:
    """What one piece of text gave: content to send on, and call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: Parsed) -> None:
        self.content += other.content
        for delta in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == delta.index and delta.id is None:
                last.arguments += delta.arguments
            else:
                self.calls.append(delta)


class _Value:
    """Scans one JSON value as it arrives: `feed` returns the part of the text that belongs to it (leading
    blanks dropped) and how much of the text it used; `done` once the value is complete."""

    def __init__(self) -> None:
        self.started = False
        self.done = False
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.scalar = False

    def feed(self, text: str) -> tuple[str, int]:
        start = None
        for i, c in enumerate(text):
            if not self.started:
                if c.isspace():
                    continue
                self.started, start = True, i
                if c in "{[":
                    self.depth = 1
                elif c == '"':
                    self.in_string = True
                else:
                    self.scalar = True
                continue
            if self.scalar:                 # a number or literal ends before the next delimiter
                if c in ",}] \t\r\n":
                    self.done = True
                    return text[start or 0:i], i
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return text[start or 0:i + 1], i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return text[start or 0:i + 1], i + 1
        return (text[start or 0:] if self.started else ""), len(text)


class ToolCallParser(ABC):
    """Finds the calls of one sequence's text. `feed` each text delta, then `finish`; `calls` holds the calls
    found (complete after `finish`)."""

    def __init__(self, tool_names: Sequence[str]) -> None:
        self.tool_names = set(tool_names)
        self.calls: list[ToolCall] = []

    @abstractmethod
    def feed(self, text: str) -> Parsed:
        """The content to send on and the call deltas that ``text`` completes."""

    @abstractmethod
    def finish(self) -> Parsed:
        """What was held back, as the text ended."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole text: its content (None when empty) and its calls."""
        out = self.feed(text)
        out.add(self.finish())
        return out.content or None, self.calls

    def _start_call(self, name: str) -> ToolCallDelta:
        call = ToolCall(name)
        self.calls.append(call)
        return ToolCallDelta(len(self.calls) - 1, "", call.id, name)

    def _add_arguments(self, text: str) -> list[ToolCallDelta]:
        if not text:
            return []
        self.calls[-1].arguments += text
        return [ToolCallDelta(len(self.calls) - 1, text)]

    def _whole_call(self, text: str) -> ToolCall | None:
        """A complete call object in any key order (the fallback when the name does not come first)."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):        # not JSON, or nested deeper than the decoder goes
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters"))
        if value["name"] not in self.tool_names or not isinstance(arguments, dict):
            return None
        call = ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
        self.calls.append(call)
        return call


def _call_name(head: re.Match) -> str | None:
    """The name in a call's head as JSON decodes it; None when it is no JSON string (a bad escape, a raw
    control character): then the text is not a call."""
    try:
        return json.loads(f'"{head.group(1)}"')
    except ValueError:
        return None


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``token``."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolCallParser):
    """``<tool_call>{...}</tool_call>`` blocks anywhere in the text."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: Sequence[str]) -> None:
        super().__init__(tool_names)
        self.pending = ""           # text held back: blanks and a partial OPEN, or the block so far
        self.in_block = False
        self.gap = ""               # the blanks before the block: content again if the block is not a call
        self.value: _Value | None = None     # the arguments of the call being streamed
        self.plain_block = False    # the block names a function the request did not offer: content
        self.after_block = False    # drop the blanks that follow a call

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self.pending += text
        while self.pending:
            if self.in_block:
                if not self._block(out):
                    break
                continue
            if self.after_block:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    break
                self.after_block = False
            at = self.pending.find(self.OPEN)
            if at >= 0:
                before = self.pending[:at]
                out.content += before.rstrip()
                self.gap = before[len(before.rstrip()):]
                self.pending = self.pending[at + len(self.OPEN):]
                self.in_block, self.value, self.plain_block = True, None, False
                continue
            keep = _partial_suffix(self.pending, self.OPEN)
            sent = self.pending[:len(self.pending) - keep].rstrip()
            out.content += sent
            self.pending = self.pending[len(sent):]
            break
        return out

    def _block(self, out: Parsed) -> bool:
        """Advance inside a block; False when it needs more text."""
        end = self.pending.find(self.CLOSE)
        if self.value is None and not self.plain_block:
            head = _HEAD.match(self.pending)
            if head is None or (end >= 0 and head.end() > end):
                if end < 0:
                    return False                    # the name is not (yet) first: wait for the block's end
                self._end_block(out, self._unstreamed(self.pending[:end], out))
                self.pending = self.pending[end + len(self.CLOSE):]
                return True
            name = _call_name(head)
            if name not in self.tool_names:
                self.plain_block = True
            else:
                out.add(Parsed(calls=[self._start_call(name)]))
                self.value = _Value()
                self.pending = self.pending[head.end():]
                end = self.pending.find(self.CLOSE)
        if self.plain_block:
            if end < 0:
                return False
            out.content += self.gap + self.OPEN + self.pending[:end + len(self.CLOSE)]
            self.pending = self.pending[end + len(self.CLOSE):]
            self._end_block(out, False)
            return True
        if not self.value.done:
            part, used = self.value.feed(self.pending)
            out.add(Parsed(calls=self._add_arguments(part)))
            self.pending = self.pending[used:]
            if not self.value.done:
                return False
            end = self.pending.find(self.CLOSE)
        if end < 0:                                 # the rest of the call object, then the end of the block
            keep = _partial_suffix(self.pending, self.CLOSE)
            self.pending = self.pending[len(self.pending) - keep:] if keep else ""
            return False
        self.pending = self.pending[end + len(self.CLOSE):]
        self._end_block(out, True)
        return True

    def _unstreamed(self, body: str, out: Parsed, closed: bool = True) -> bool:
        """A block whose name did not come first: one call if it is a whole call object, else content."""
        call = self._whole_call(body)
        if call is None:
            out.content += self.gap + self.OPEN + body + (self.CLOSE if closed else "")
            return False
        out.add(Parsed(calls=[ToolCallDelta(len(self.calls) - 1, call.arguments, call.id, call.name)]))
        return True

    def _end_block(self, out: Parsed, was_call: bool) -> None:
        self.in_block, self.value, self.plain_block, self.gap = False, None, False, ""
        self.after_block = was_call

    def finish(self) -> Parsed:
        out = Parsed()
        if not self.in_block:                       # trailing blanks, or a partial OPEN that never completed
            out.content = self.pending if not self.calls or self.pending.strip() else ""
        elif self.plain_block:                      # an unclosed block
            out.content = self.gap + self.OPEN + self.pending
        elif self.value is None:
            self._unstreamed(self.pending, out, closed=False)
        self.pending = ""
        self._end_block(out, False)
        return out


class Llama3JsonParser(ToolCallParser):
    """The whole reply is one call object, or several separated by ``;`` (after an optional ``<|python_tag|>``);
    a reply that does not start with ``{`` is content."""

    TAG = "<|python_tag|>"

    def __init__(self, tool_names: Sequence[str]) -> None:
        super().__init__(tool_names)
        self.pending = ""
        self.state = "start"        # start | head | arguments | tail | between | text
        self.value: _Value | None = None
        self.tail = _Value()
        self.raw = ""               # every character seen, for the fallback

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self.raw += text
        if self.state == "text":
            out.content = text
            return out
        self.pending += text
        while self.pending and self.state != "text":
            if self.state in ("start", "between"):
                rest = self.pending.lstrip()
                if self.state == "start" and rest.startswith(self.TAG):
                    rest = rest[len(self.TAG):].lstrip()
                if self.state == "between":
                    rest = rest.lstrip("; \t\r\n")
                if not rest or (self.state == "start" and self.TAG.startswith(rest)):
                    break
                if not rest.startswith("{"):
                    return self._to_text(out, rest)
                self.pending, self.state = rest, "head"
            if self.state == "head":
                head = _HEAD.match(self.pending)
                if head is None:
                    break                           # name not first (or not yet): wait for the whole text
                name = _call_name(head)
                if name not in self.tool_names:
                    return self._to_text(out, self.pending)
                out.add(Parsed(calls=[self._start_call(name)]))
                self.pending, self.state, self.value = self.pending[head.end():], "arguments", _Value()
            if self.state == "arguments":
                part, used = self.value.feed(self.pending)
                out.add(Parsed(calls=self._add_arguments(part)))
                self.pending = self.pending[used:]
                if not self.value.done:
                    break
                self.state, self.tail = "tail", _Value()
                self.tail.feed("{")                 # the rest of the call object, to its closing brace
            if self.state == "tail":
                _, used = self.tail.feed(self.pending)
                self.pending = self.pending[used:]
                if not self.tail.done:
                    break
                self.state = "between"
        return out

    def _to_text(self, out: Parsed, rest: str) -> Parsed:
        """Not (or no longer) calls: the text from here on is content (before any call: all of it)."""
        out.content += self.raw if not self.calls else rest
        self.state, self.pending = "text", ""
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self.state == "head":                    # a call object whose name did not come first
            decoder, rest, found = json.JSONDecoder(), self.pending, []
            try:
                while rest.strip().lstrip(";").strip():
                    rest = rest.strip().lstrip(";").strip()
                    value, end = decoder.raw_decode(rest)
                    found.append(json.dumps(value))
                    rest = rest[end:]
            except (ValueError, RecursionError):
                found = None
            calls = [self._whole_call(text) for text in found or ()]
            if found and all(calls):
                out.calls = [ToolCallDelta(self.calls.index(c), c.arguments, c.id, c.name) for c in calls]
            else:
                for c in calls:
                    if c is not None:
                        self.calls.remove(c)
                out.content = self.raw if not self.calls else self.pending
        elif self.state == "start" and not self.calls:
            out.content = self.raw if self.raw.strip() else ""
        self.pending, self.state = "", "text"
        return out


class ToolFormat(ABC):
    """A model family's tool-call syntax: `grammar` forces it, `parser` reads it; `tags` are the markers its
    calls carry, which some tokenizers hold as special tokens (`tags_are_special`)."""

    name: str
    tags: tuple[str, ...] = ()

    def tags_are_special(self, tokenizer) -> bool:
        """Whether the tokenizer writes one of `tags` as a single special token, which decoding with
        ``skip_special_tokens`` drops: the reply's text would then lose the markers the parser looks for."""
        return any(_special_token(tokenizer, tag) for tag in self.tags)

    @abstractmethod
    def parser(self, tool_names: Sequence[str]) -> ToolCallParser: ...

    @abstractmethod
    def grammar(self, tools: Sequence[tuple[str, dict]], parallel: bool) -> str:
        """A Lark grammar of one call (``parallel``: one or more) to any of ``tools`` ((name, parameters
        schema) pairs), each call's arguments matching its tool's schema."""


def _call_rules(tools: Sequence[tuple[str, dict]], arguments_key: str) -> tuple[str, list[str]]:
    """``call_body: tool_0 | tool_1 ...`` and one ``%json`` rule per tool: {name: const, <key>: schema}."""
    rules = []
    for i, (name, parameters) in enumerate(tools):
        schema = call_schema(name, parameters, arguments_key)
        rules.append(f"tool_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "call_body: " + " | ".join(f"tool_{i}" for i in range(len(tools))), rules


def call_schema(name: str, parameters: dict, arguments_key: str) -> dict:
    """The JSON Schema of one call object: ``{"name": <name>, <arguments_key>: <parameters>}``, with the
    parameters' ``$defs`` moved to the top and their local ``$ref`` s pointed at their new place."""
    parameters = dict(parameters)
    defs = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    schema = {"type": "object", "properties": {"name": {"const": name},
                                               arguments_key: _moved_refs(parameters, arguments_key)},
              "required": ["name", arguments_key], "additionalProperties": False,
              "x-guidance": CALL_JSON_OPTIONS}
    schema.update(defs)
    return schema


def _moved_refs(value, arguments_key: str):
    """Local ``$ref`` s into the parameters schema itself (``#``, ``#/properties/...``) rewritten to its place
    under ``properties.<arguments_key>``; ``#/$defs/...`` stay (the definitions move to the top)."""
    if isinstance(value, list):
        return [_moved_refs(v, arguments_key) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        if key == "$ref" and isinstance(item, str) and (item == "#" or item.startswith("#/")) and \
                not item.startswith(("#/$defs/", "#/definitions/")):
            item = f"#/properties/{arguments_key}" + item[1:]
        out[key] = _moved_refs(item, arguments_key)
    return out


def _special_token(tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == ""


class HermesFormat(ToolFormat):
    name = "hermes"
    tags = ("<tool_call>", "</tool_call>")

    def parser(self, tool_names: Sequence[str]) -> ToolCallParser:
        return HermesParser(tool_names)

    def grammar(self, tools: Sequence[tuple[str, dict]], parallel: bool) -> str:
        body, rules = _call_rules(tools, "arguments")
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, 'call: "<tool_call>\\n" call_body "\\n</tool_call>"', body, *rules])


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    tags = ("<|python_tag|>",)

    def parser(self, tool_names: Sequence[str]) -> ToolCallParser:
        return Llama3JsonParser(tool_names)

    def grammar(self, tools: Sequence[tuple[str, dict]], parallel: bool) -> str:
        body, rules = _call_rules(tools, "parameters")
        start = 'start: call_body ("; " call_body)*' if parallel else "start: call_body"
        return "\n".join([start, body, *rules])


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}


def tool_format(tool_parser: str, chat_template_source: str = "") -> ToolFormat | None:
    """The format of ``model.tool_parser`` (`TOOL_PARSERS`); ``auto`` reads the chat template, ``none`` is None.

    Raises:
        ValueError: an unknown name.
    """
    if tool_parser == "none":
        return None
    if tool_parser == "auto":
        source = chat_template_source
        if "<tool_call>" in source:
            return FORMATS["hermes"]
        if "<|python_tag|>" in source or '"parameters": dictionary' in source:
            return FORMATS["llama3_json"]
        return FORMATS["hermes"]
    if tool_parser not in FORMATS:
        raise ValueError(f"tool_parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_parser!r}")
    return FORMATS[tool_parser]
