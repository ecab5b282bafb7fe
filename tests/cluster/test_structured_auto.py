"""Structured outputs in routing.mode auto, through both front doors of a real 1P1D cluster: whichever
placement the router picks per request (the prefill actor plus a KV handoff, or chunked prefill on the
decode actor), a constrained request draws the tokens of one colocated engine and its document validates."""
from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from engine import Engine, EngineArgs, SamplingParams
from engine.sampling.structured import StructuredOutput
from engine.tokenizer import Tokenizer
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router import build_request

from cluster_helpers import ClusterThread, cluster_config, wait_blocks_free

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count"],
          "properties": {"name": {"enum": ["ada", "bob", "cy"]}, "count": {"type": "integer", "minimum": 0,
                                                                          "maximum": 50}}}
PROMPTS = {"short": list(range(40, 52)), "long": list(range(100, 400))}


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model_dir):
    c = ClusterThread(cluster_config(tiny_model_dir, "grpc", "none", mode="auto"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def colocated(tiny_model_dir):
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=256))
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))

    def run(prompt: list[int], **sampling) -> list[int]:
        [out] = engine.generate([prompt], SamplingParams(max_tokens=120, structured=spec, **sampling))
        return out.token_ids
    return run


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=5)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("size", PROMPTS)
def test_grpc_constrained_request_in_auto_mode(cluster, colocated, size, sampling):
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA)).to_proto()
    with grpc.insecure_channel(cluster.address) as channel:
        out = list(pb_grpc.GenerationServiceStub(channel).Generate(
            build_request(token_ids=PROMPTS[size], max_tokens=120, structured=spec, **sampling), timeout=60))
    assert [t for m in out for t in m.token_ids] == colocated(PROMPTS[size], **sampling)
    jsonschema.validate(json.loads("".join(m.text for m in out)), SCHEMA)
    stats = wait_blocks_free(cluster.address)
    assert all(a.kv_blocks_used == 0 for a in stats.actors), stats


@pytest.mark.parametrize("size", PROMPTS)
def test_http_response_format_in_auto_mode(cluster, colocated, tiny_model_dir, size):
    client = openai.OpenAI(base_url=cluster.cluster.server.http_url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    try:
        reply = client.completions.create(
            model=client.models.list().data[0].id, prompt=PROMPTS[size], max_tokens=120, temperature=0.0,
            extra_body={"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}})
    finally:
        client.close()
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)
    tokens = Tokenizer(tiny_model_dir).decode(colocated(PROMPTS[size], temperature=0.0))
    assert reply.choices[0].text == tokens
