"""Denormal temperature / repetition_penalty: the router refuses them
INVALID_ARGUMENT naming the field and its floor, before anything reaches the backend."""
from __future__ import annotations

import grpc
import pytest

from engine.sampling.params import MIN_REPETITION_PENALTY, MIN_TEMPERATURE
from proto.pdserve.v1 import generation_pb2 as pb
from router import build_request


@pytest.mark.parametrize("field,value", [
    ("temperature", 1e-45), ("temperature", 1e-30), ("temperature", MIN_TEMPERATURE / 4),
    ("repetition_penalty", 1e-45), ("repetition_penalty", MIN_REPETITION_PENALTY / 4),
])
def test_below_the_floor_is_invalid_argument_naming_the_field(server, channel, field, value):
    stub = server.stub(channel)
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Generate(build_request("abc", request_id="tiny", **{field: value}), timeout=5))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in exc.value.details() and "1e-05" in exc.value.details()
    assert "tiny" not in server.backend.inputs


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=MIN_TEMPERATURE),
                                      dict(repetition_penalty=MIN_REPETITION_PENALTY)])
def test_greedy_and_the_floors_are_served(server, channel, sampling):
    msgs = list(server.stub(channel).Generate(build_request("abc", max_tokens=3, **sampling), timeout=5))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
