"""Structured outputs through the front doors, over real engines (the tiny random-weight model; one prefill and
one decode worker under the router's Dispatcher: every request is prefilled, its KV shipped, then decoded):
every output of a constrained request matches its constraint, whatever the sampling; bad specs are refused
at the router (400 / INVALID_ARGUMENT naming the problem) before any actor sees them; a seeded constrained
request draws the same tokens disaggregated as in one colocated engine."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import httpx
import jsonschema
import openai
import pytest
from openai_support import EngineCluster
from pydantic import BaseModel, Field

import router.validation
from engine import Engine, EngineArgs, SamplingParams
from engine.sampling.structured import StructuredOutput
from proto.pdserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
from router import build_request

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
SCHEMAS = {
    "nested objects": {
        "type": "object", "additionalProperties": False, "required": ["user"],
        "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["name", "home"],
                                "properties": {"name": {"type": "string", "maxLength": 6},
                                               "home": {"type": "object", "additionalProperties": False,
                                                        "required": ["zip"],
                                                        "properties": {"zip": {"type": "integer", "minimum": 0,
                                                                               "maximum": 999}}}}}}},
    "arrays": {
        "type": "object", "additionalProperties": False, "required": ["ids"],
        "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                               "minItems": 1, "maxItems": 4},
                       "flags": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}}},
    "enums": {
        "type": "object", "additionalProperties": False, "required": ["color", "size"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, "big", None]}}},
    "bounded numbers": {
        "type": "object", "additionalProperties": False, "required": ["age", "ratio"],
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                       "delta": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3}}},
    "required and optional": {
        "type": "object", "additionalProperties": False, "required": ["id"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                       "note": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}}},
    "anyOf": {
        "type": "object", "additionalProperties": False, "required": ["value"],
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"type": "string", "maxLength": 3},
                                           {"type": "array", "maxItems": 2, "items": {"type": "null"}}]}}},
}


@pytest.fixture(scope="module")
def engines(loop_thread, tiny_model_dir):
    cluster = EngineCluster(tiny_model_dir, loop_thread)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def served(engines):
    server = engines.serve()
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield server, client
    client.close()


def _in_parallel(calls):
    """Run the thunks at once (one batch for the engines); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_every_output_validates_against_its_schema(served):
    """Six schemas × (greedy + three seeded samples at temperature 1): every choice parses and validates."""
    _, client = served

    def ask(schema, **sampling):
        return lambda: client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}},
            **sampling)
    calls = [ask(schema, temperature=0.0) for schema in SCHEMAS.values()]
    calls += [ask(schema, temperature=1.0, n=3, seed=7) for schema in SCHEMAS.values()]
    answers = _in_parallel(calls)
    for i, answer in enumerate(answers):
        schema = list(SCHEMAS.values())[i % len(SCHEMAS)]
        for choice in answer.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
    sampled = [c.message.content for a in answers[len(SCHEMAS):] for c in a.choices]
    assert len(set(sampled)) > len(SCHEMAS)            # the seeds draw different documents


def test_guided_fields_on_both_endpoints(served):
    """guided_json (object and text), guided_regex, guided_choice and json_object, through completions and chat."""
    _, client = served
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    choices = ["positive", "negative", "not sure"]
    schema = SCHEMAS["enums"]
    regex, choice, as_text, json_object, chat_json = _in_parallel([
        lambda: client.completions.create(model="tiny", prompt="Mail:", max_tokens=40, n=3, seed=1,
                                          extra_body={"guided_regex": pattern}),
        lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, n=3, seed=2,
                                               extra_body={"guided_choice": choices}),
        lambda: client.completions.create(model="tiny", prompt="Colour:", max_tokens=200, n=2, seed=3,
                                          extra_body={"guided_json": json.dumps(schema)}),
        lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, n=3, seed=4,
                                               response_format={"type": "json_object"}),
        lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, seed=5,
                                               extra_body={"guided_json": schema}),
    ])
    for c in regex.choices:
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c.text
    for c in choice.choices:
        assert c.finish_reason == "stop" and c.message.content in choices, c.message.content
    for text in [c.text for c in as_text.choices] + [chat_json.choices[0].message.content]:
        jsonschema.validate(json.loads(text), schema)
    for c in json_object.choices:           # any object: a random model may run to max_tokens inside a key
        assert c.message.content.lstrip().startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)


class Alert(BaseModel):
    level: Literal["low", "high"]
    code: int = Field(ge=0, le=99)


class Weather(BaseModel):
    city: str = Field(max_length=8)
    celsius: int = Field(ge=-40, le=50)
    alerts: list[Alert] = Field(max_length=2)


def test_openai_sdk_parse_returns_the_model_and_streams_the_same(served):
    """`client.chat.completions.parse(response_format=<pydantic model>)` (nested models: `$defs`), and the
    same seeded request streamed through the SDK's stream helper."""
    _, client = served
    parsed = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Weather,
                                           max_tokens=150, temperature=0.7, seed=3)
    weather = parsed.choices[0].message.parsed
    assert isinstance(weather, Weather) and parsed.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, response_format=Weather,
                                        max_tokens=150, temperature=0.7, seed=3) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == weather


def test_bad_specs_are_refused_at_the_router_naming_the_problem(served, engines):
    server, client = served
    url = server.http_url + "/v1"
    cases = [
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
         r"response_format\.json_schema\.schema: .*uniqueItems", "response_format"),
        ("completions", {"guided_json": {"type": "string", "format": "color"}}, r"guided_json: .*format",
         "guided_json"),
        ("completions", {"guided_regex": "a(b"}, r"guided_regex: .*unclosed group", "guided_regex"),
        ("chat/completions", {"guided_regex": "(?=a)b"}, r"guided_regex: .*look-around", "guided_regex"),
        ("completions", {"guided_grammar": 'root ::= "a" | missing'}, r"guided_grammar: .*missing",
         "guided_grammar"),
        ("chat/completions", {"guided_regex": "a+", "guided_choice": ["a"]},
         r"guided_regex and guided_choice: give at most one", "guided_choice"),
        ("chat/completions", {"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
         r"response_format and guided_json", "guided_json"),
        ("completions", {"guided_choice": []}, r"guided_choice must be a non-empty list", "guided_choice"),
        ("completions", {"guided_json": "{not json"}, r"guided_json is not valid JSON", "guided_json"),
    ]
    before = [e.scheduler.num_queued for e in engines.engines]
    for path, extra, message, param in cases:
        body = {"model": "tiny", "max_tokens": 5, **extra}
        body.update({"messages": MESSAGES} if path.startswith("chat") else {"prompt": "Hi"})
        r = httpx.post(f"{url}/{path}", json=body, timeout=10)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert re.search(message, error["message"]), error
        assert error["param"] == param and error["type"] == "invalid_request_error"
    assert [e.scheduler.num_queued for e in engines.engines] == before and not any(
        e.has_unfinished() for e in engines.engines)                    # no actor saw any of them
    ok = client.completions.create(model="tiny", prompt="Hi", max_tokens=5, extra_body={"guided_choice": ["yes"]})
    assert ok.choices[0].text == "yes"                                 # the router keeps serving


def test_grpc_structured_field_is_validated_and_enforced(served):
    server, _ = served
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        bad = StructuredOutput(json_schema={"not": {"type": "string"}}).to_proto()
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(build_request("Hi", max_tokens=5, structured=bad), timeout=10))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(r"sampling\.structured\.json_schema: .*not", refused.value.details())
        spec = StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}").to_proto()
        out = list(stub.Generate(build_request("Call", max_tokens=20, seed=3, structured=spec), timeout=30))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", "".join(m.text for m in out))
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP


def test_a_spec_the_engine_refuses_is_a_400_naming_it(served, monkeypatch):
    """Were the router's check skipped, the engine's own refusal (a ValueError at add_request) still comes
    back as INVALID_ARGUMENT → 400 with its message, and holds nothing."""
    _, client = served
    monkeypatch.setattr(router.validation, "_grammar_error", lambda spec: None)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=5, extra_body={"guided_regex": "(?=a)b"})
    assert re.search(r"structured\.regex: .*look-around", refused.value.body["message"])


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.7, seed=11)],
                         ids=["greedy", "seeded"])
def test_disaggregated_draws_what_one_colocated_engine_draws(served, tiny_model_dir, sampling):
    """Prefill worker (first token under the mask) → KV handoff → decode worker (its matcher replays that
    token): the tokens of one colocated engine, and the document validates."""
    server, _ = served
    schema = SCHEMAS["anyOf"]
    spec = StructuredOutput(json_schema=json.dumps(schema))
    prompt = list(range(300, 341))
    with grpc.insecure_channel(server.address) as channel:
        out = list(pb_grpc.GenerationServiceStub(channel).Generate(
            build_request(token_ids=prompt, max_tokens=60, structured=spec.to_proto(), **sampling), timeout=30))
    tokens = [t for m in out for t in m.token_ids]
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64, attention="eager"))
    [colocated] = engine.generate([prompt], SamplingParams(max_tokens=60, structured=spec, **sampling))
    assert tokens == colocated.token_ids
    jsonschema.validate(json.loads("".join(m.text for m in out)), schema)


def test_the_router_checks_specs_without_torch():
    """The router's check is the engine's `to_llguidance` (no tokenizer): the router process never loads torch."""
    import subprocess
    import sys
    code = ("import sys, router.openai_api, router.validation as v; from engine.sampling.structured import "
            "StructuredOutput as S; v.check_structured(S(json_schema={'type': 'object'})); "
            "assert 'torch' not in sys.modules, 'torch loaded'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
