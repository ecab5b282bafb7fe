"""Table-driven bad requests through gRPC: right status, a message naming the field,
nothing reaches the backend, and the server keeps serving."""
from __future__ import annotations

import logging
import math
import threading

import grpc
import pytest

from proto.pdserve.v1 import generation_pb2 as pb
from router import build_request, generate

MAX_MODEL_LEN = 128  # FakeBackend default
VOCAB_SIZE = 258


def _req(prompt: str | None = "abc", token_ids=None, request_id: str = "", **sampling) -> pb.GenerateRequest:
    if token_ids is not None:
        prompt = None
    return build_request(prompt, token_ids=token_ids, request_id=request_id, **sampling)


INVALID = "INVALID_ARGUMENT"

# (case id, request, status name, substrings the message must contain)
CASES = [
    ("no_input", pb.GenerateRequest(), INVALID, ["input", "prompt", "token_ids"]),
    ("empty_prompt", _req(""), INVALID, ["prompt"]),
    ("empty_token_ids", pb.GenerateRequest(token_ids=pb.TokenIds()), INVALID, ["token_ids"]),
    ("token_id_eq_vocab", _req(token_ids=[1, VOCAB_SIZE]), INVALID, ["token_ids.ids[1]", "258", "vocab_size"]),
    ("token_id_uint32_max", _req(token_ids=[2**32 - 1]), INVALID, ["token_ids.ids[0]", "4294967295"]),
    ("prompt_beyond_context", _req("x" * 200), INVALID, ["200 tokens", "max_model_len (128)"]),
    ("prompt_fills_context", _req("x" * 128, max_tokens=1), INVALID, ["128 tokens", "max_model_len"]),
    ("prompt_plus_max_tokens_one_over", _req("x" * 100, max_tokens=29), INVALID,
     ["100 tokens", "sampling.max_tokens (29)", "129", "max_model_len (128)"]),
    ("max_tokens_huge", _req(max_tokens=2**32 - 1), INVALID, ["max_tokens", "4294967295", "max_model_len"]),
    ("max_tokens_zero", _req(max_tokens=0), INVALID, ["sampling.max_tokens", ">= 1"]),
    ("temperature_nan", _req(temperature=math.nan), INVALID, ["sampling.temperature", "nan"]),
    ("temperature_inf", _req(temperature=math.inf), INVALID, ["sampling.temperature", "inf"]),
    ("temperature_negative", _req(temperature=-0.5), INVALID, ["sampling.temperature"]),
    ("top_p_zero", _req(top_p=0.0), INVALID, ["sampling.top_p", "(0, 1]"]),
    ("top_p_above_one", _req(top_p=1.5), INVALID, ["sampling.top_p"]),
    ("top_p_nan", _req(top_p=math.nan), INVALID, ["sampling.top_p"]),
    ("repetition_penalty_zero", _req(repetition_penalty=0.0), INVALID, ["sampling.repetition_penalty"]),
    ("repetition_penalty_high", _req(repetition_penalty=3.0), INVALID, ["sampling.repetition_penalty", "(0, 2]"]),
    ("repetition_penalty_inf", _req(repetition_penalty=math.inf), INVALID, ["sampling.repetition_penalty"]),
    ("frequency_penalty_high", _req(frequency_penalty=2.5), INVALID, ["sampling.frequency_penalty", "[-2, 2]"]),
    ("frequency_penalty_low", _req(frequency_penalty=-3.0), INVALID, ["sampling.frequency_penalty"]),
    ("presence_penalty_nan", _req(presence_penalty=math.nan), INVALID, ["sampling.presence_penalty"]),
    ("presence_penalty_high", _req(presence_penalty=5.0), INVALID, ["sampling.presence_penalty"]),
    ("too_many_stop_strings", _req(stop=[f"s{i}" for i in range(17)]), INVALID, ["sampling.stop", "16", "17"]),
    ("stop_string_too_long", _req(stop=["x" * 257]), INVALID, ["sampling.stop", "256"]),
    ("empty_stop_string", _req(stop=["ok", ""]), INVALID, ["sampling.stop"]),
    ("request_id_too_long", _req(request_id="r" * 257), INVALID, ["request_id", "256", "257"]),
    ("request_id_control_char", _req(request_id="bad\x00id"), INVALID, ["request_id", "printable"]),
    ("request_id_newline", _req(request_id="bad\nid"), INVALID, ["request_id"]),
    ("request_id_padded", _req(request_id=" padded"), INVALID, ["request_id", "whitespace"]),
]


def _raw_generate(channel: grpc.Channel, data: bytes):
    """Send raw bytes as a GenerateRequest (to test bytes no client library would build)."""
    call = channel.unary_stream(
        "/pdserve.v1.GenerationService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    return list(call(data, timeout=10))


RAW_CASES = [
    # field 2 (prompt, wire type 2) holding bytes that are not UTF-8
    ("prompt_invalid_utf8", b"\x12\x03\xff\xfe\xfd", ["request", "GenerateRequest"]),
    ("truncated_message", b"\x12\x10abc", ["request", "GenerateRequest"]),
    ("garbage_bytes", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", ["request", "GenerateRequest"]),
]


def _assert_still_serving(address: str) -> None:
    responses = list(generate(address, "ok?", max_tokens=3, timeout=10))
    assert "".join(r.text for r in responses) == "?ko"


def test_table_has_at_least_25_cases():
    assert len(CASES) + len(RAW_CASES) + 3 >= 25  # + stats, oversized message, duplicate request_id


@pytest.mark.parametrize("request_msg,code,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(server, channel, request_msg, code, needles):
    stub = server.stub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request_msg, timeout=10))
    assert e.value.code() == grpc.StatusCode[code], e.value.details()
    for needle in needles:
        assert needle in e.value.details()
    assert not server.backend.inputs  # nothing reached the backend
    _assert_still_serving(server.address)


@pytest.mark.parametrize("data,needles", [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_unparsable_request(server, channel, data, needles):
    with pytest.raises(grpc.RpcError) as e:
        _raw_generate(channel, data)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    for needle in needles:
        assert needle in e.value.details()
    _assert_still_serving(server.address)


def test_unparsable_stats_request_is_invalid_argument(server, channel, caplog):
    get_stats = channel.unary_unary("/pdserve.v1.GenerationService/GetStats", request_serializer=lambda b: b,
                                    response_deserializer=pb.GetStatsResponse.FromString)
    caplog.set_level(logging.ERROR)
    with pytest.raises(grpc.RpcError) as e:
        get_stats(RAW_CASES[2][1], timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()   # was UNKNOWN, and a traceback
    assert "GetStatsRequest" in e.value.details()
    assert not caplog.records
    assert len(get_stats(b"", timeout=10).actors) == 2


def test_oversized_message_is_resource_exhausted(serve):
    running = serve(max_message_bytes=64 * 1024)
    with pytest.raises(grpc.RpcError) as e:
        list(generate(running.address, "x" * (100 * 1024), timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "message" in e.value.details().lower()
    assert not running.backend.inputs
    _assert_still_serving(running.address)


def test_duplicate_request_id_in_flight_is_already_exists(server, wait_until):
    server.backend.release.clear()
    first = generate(server.address, "abc", request_id="dup", max_tokens=2, timeout=10)
    first_iter = iter(first)
    # the first call runs on a helper thread: it blocks until the backend is released
    results: list[list[pb.GenerateResponse]] = []
    worker = threading.Thread(target=lambda: results.append(list(first_iter)))
    worker.start()
    wait_until(lambda: "dup" in server.backend.active)
    with pytest.raises(grpc.RpcError) as e:
        list(generate(server.address, "xyz", request_id="dup", timeout=10))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in e.value.details() and "dup" in e.value.details()
    server.backend.release.set()
    worker.join(10)
    assert results and results[0][-1].finish_reason == pb.FINISH_REASON_LENGTH
    # once finished, the id may be reused
    assert list(generate(server.address, "abc", request_id="dup", max_tokens=1, timeout=10))
