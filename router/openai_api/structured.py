"""The OpenAI / vLLM structured-output fields of a request → one `StructuredOutput` (or none).

=========================================================== ===================================
field (both endpoints)                                      constrains the output to
=========================================================== ===================================
``response_format: {"type": "text"}``                       nothing (the default)
``response_format: {"type": "json_object"}``                any JSON object
``response_format: {"type": "json_schema", "json_schema":   the JSON Schema ``schema`` (without one:
{"name", "schema", "strict"}}``                             any JSON object)
``guided_json`` (a schema object, or its JSON text)         that JSON Schema
``guided_regex``                                            the regular expression (whole output)
``guided_choice`` (a list of strings)                       exactly one of the strings
``guided_grammar``                                          the GBNF (``root``) or Lark (``start``) grammar
=========================================================== ===================================

At most one may be set (400 naming those sent). The spec is checked here, before the request is admitted,
with the engine's own `to_llguidance` (no tokenizer, no torch; cached per spec), so an unsupported schema
keyword or an invalid regex is a 400 naming the field and the problem, and never reaches an actor.
"""
from __future__ import annotations

import json
import re

from engine.sampling.structured import StructuredOutput
from router.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from router.validation import check_structured, invalid

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def requested_fields(body: CompletionRequest | ChatCompletionRequest) -> list[str]:
    """The structured-output fields the body sets (``response_format`` of type text does not count)."""
    names = [n for n in GUIDED_FIELDS if getattr(body, n) is not None]
    if body.response_format is not None and body.response_format.type != "text":
        names.insert(0, "response_format")
    return names


def structured_output(body: CompletionRequest | ChatCompletionRequest) -> tuple[StructuredOutput | None, str]:
    """The body's constraint and the field it came from (``(None, "")`` when there is none).

    Raises:
        RequestError: INVALID_ARGUMENT naming the field: several set, a malformed or unsupported spec.
    """
    names = requested_fields(body)
    if not names:
        if body.response_format is not None and body.response_format.json_schema is not None:
            raise invalid("response_format.json_schema is only allowed with type json_schema", "response_format")
        return None, ""
    if len(names) > 1:
        raise invalid(f"{' and '.join(names)}: give at most one structured-output field", names[1])
    [name] = names
    if name == "response_format":
        spec, where = _response_format(body)
    elif name == "guided_json":
        spec, where = _guided_json(body.guided_json), "guided_json"
    elif name == "guided_regex":
        spec, where = StructuredOutput(regex=body.guided_regex), "guided_regex"
    elif name == "guided_choice":
        spec, where = StructuredOutput(choice=tuple(body.guided_choice)), "guided_choice"
    else:
        spec, where = StructuredOutput(grammar=body.guided_grammar), "guided_grammar"
    check_spec(spec, where, name)
    return spec, name


def check_spec(spec: StructuredOutput, where: str, param: str) -> None:
    """`check_structured` with the engine's ``structured.<kind>`` in the message replaced by ``where``.

    Raises:
        RequestError: INVALID_ARGUMENT naming ``param``.
    """
    try:
        check_structured(spec)
    except ValueError as e:
        message = re.sub(r"^structured(\.\w+)?", where, str(e), count=1)
        raise invalid(message if message.startswith(where) else f"{where}: {message}", param) from None


def _response_format(body) -> tuple[StructuredOutput, str]:
    fmt = body.response_format
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise invalid("response_format.json_schema is only allowed with type json_schema", "response_format")
        return StructuredOutput(json_object=True), "response_format"
    if fmt.json_schema is None:
        raise invalid("response_format: type json_schema needs json_schema: {\"name\", \"schema\"}", "response_format")
    if fmt.json_schema.schema_ is None:
        return StructuredOutput(json_object=True), "response_format"
    return StructuredOutput(json_schema=json.dumps(fmt.json_schema.schema_)), "response_format.json_schema.schema"


def _guided_json(value: dict | str) -> StructuredOutput:
    return StructuredOutput(json_schema=json.dumps(value) if isinstance(value, dict) else value)
