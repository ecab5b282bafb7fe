"""`StructuredOutput`: the grammar a request's output must match (mirrors the gRPC message; loads without torch).

Exactly one kind is set: ``json_schema`` (a JSON Schema as JSON text), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of a list of strings) or ``grammar`` (GBNF or Lark). `validate`
checks the shape and the size bounds only; what the grammar library cannot express (an unsupported
schema keyword, look-around in a regex, an undefined rule) is found by `to_llguidance`, which needs no
tokenizer and no torch: the router calls it before a request is admitted, the engine again when the spec
is compiled (engine/sampling/grammar.py), still before the request is queued.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import llguidance

from proto.pdserve.v1 import generation_pb2

MAX_SPEC_CHARS = 64 * 1024          # a schema, regex or grammar; the choices together
MAX_CHOICES = 1024
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON: up to 24 whitespace characters between two tokens (a pretty-printed line break and indentation to
# depth 5 at 4 spaces, 11 at 2), never more, so a model that keeps emitting blanks cannot stall a document.
# Properties come in the schema's order; others are allowed unless the schema says
# "additionalProperties": false (JSON Schema's default).
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}"}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One of the kinds below (hashable: compiled grammars are cached by it).

    ``json_schema`` may be given as a mapping; it is kept as JSON text (key order preserved).
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, Mapping):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str | None:
        """The kind that is set (the first, if a bad spec sets several)."""
        return next((k for k in KINDS if getattr(self, k) not in (None, False)), None)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when the spec is malformed or too large."""
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            got = ", ".join(kinds) if kinds else "none"
            raise ValueError(f"structured: exactly one of {', '.join(KINDS)} must be set, got {got}")
        if self.json_object is not False and self.json_object is not True:
            raise ValueError(f"structured.json_object must be true or false, got {self.json_object!r}")
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured.{name} must be a non-empty string, got {value!r:.80}")
            if len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"structured.{name} must be at most {MAX_SPEC_CHARS} characters, got {len(value)}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured.json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured.json_schema must be a JSON object, got {type(schema).__name__}")
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not self.choice:
                raise ValueError("structured.choice must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured.choice must hold at most {MAX_CHOICES} strings, got {len(self.choice)}")
            if not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured.choice must hold only strings")
            total = sum(map(len, self.choice))
            if total > MAX_SPEC_CHARS:
                raise ValueError(f"structured.choice must total at most {MAX_SPEC_CHARS} characters, got {total}")

    @classmethod
    def from_proto(cls, msg: generation_pb2.StructuredOutput) -> StructuredOutput:
        """Proto → spec; a message with no kind set gives a spec that `validate` refuses."""
        kind = msg.WhichOneof("kind")
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "choice":
            return cls(choice=tuple(msg.choice.options))
        return cls(**{kind: getattr(msg, kind)}) if kind else cls()

    def to_proto(self) -> generation_pb2.StructuredOutput:
        msg = generation_pb2.StructuredOutput()
        kind = self.kind
        if kind == "json_object":
            msg.json_object.SetInParent()
        elif kind == "choice":
            msg.choice.options.extend(self.choice)
        elif kind is not None:
            setattr(msg, kind, getattr(self, kind))
        return msg


def to_llguidance(spec: StructuredOutput) -> str:
    """The llguidance grammar of a validated spec; ValueError naming what llguidance refuses."""
    kind = spec.kind
    try:
        if kind in ("json_schema", "json_object"):
            schema = spec.json_schema if kind == "json_schema" else '{"type": "object"}'
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.regex)
        elif kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
        else:
            grammar = llguidance.grammar_from("grammar", spec.grammar)       # GBNF is converted to Lark
    except ValueError as e:
        raise ValueError(f"structured.{kind}: {first_line(str(e))}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"structured.{kind}: {first_line(messages[0])}")
    return grammar


def first_line(message: str) -> str:
    """llguidance's message without its echo of the input and state dump: the first line, plus the
    `error: ...` line a regex parse error puts further down."""
    lines = [line.strip() for line in message.strip().splitlines()] or [""]
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return lines[0] if detail is None else f"{lines[0]} {detail}"
