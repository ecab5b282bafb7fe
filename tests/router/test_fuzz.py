"""Property-based fuzz of GenerateRequest: validation either yields a sound input or a
clear INVALID_ARGUMENT; through gRPC nothing ends in INTERNAL/UNKNOWN and nothing leaks."""
from __future__ import annotations

import grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proto.pdserve.v1 import generation_pb2 as pb
from router.validation import MAX_REQUEST_ID_CHARS, RequestError, validate_request

MAX_MODEL_LEN = 128
UINT32 = 2**32 - 1

floats32 = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, 2.0, -2.0, 0.5, 1e-30, 3.4e38]),
)
uints32 = st.one_of(st.integers(0, 300), st.integers(0, UINT32))


@st.composite
def sampling_params(draw) -> pb.SamplingParams:
    p = pb.SamplingParams()
    for name in ("temperature", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        if draw(st.booleans()):
            setattr(p, name, draw(floats32))
    if draw(st.booleans()):
        p.max_tokens = draw(st.one_of(st.integers(0, 40), uints32))
    if draw(st.booleans()):
        p.top_k = draw(uints32)
    if draw(st.booleans()):
        p.seed = draw(st.integers(0, 2**64 - 1))
    p.stop.extend(draw(st.lists(st.text(max_size=300), max_size=18)))
    p.ignore_eos = draw(st.booleans())
    return p


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.text(max_size=MAX_REQUEST_ID_CHARS + 20))),
    )
    kind = draw(st.sampled_from(["none", "prompt", "token_ids"]))
    if kind == "prompt":
        request.prompt = draw(st.text(max_size=160))
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, 260), uints32), max_size=140)))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling_params()))
    return request


class _Tokenizer:
    vocab_size = 258
    eos_token_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


@settings(max_examples=2000, deadline=None, derandomize=True)
@given(generate_requests())
def test_validation_is_total(request):
    try:
        inp = validate_request(request, _Tokenizer(), MAX_MODEL_LEN)
    except RequestError as e:
        assert e.code == "INVALID_ARGUMENT" and e.message
        return
    inp.params.validate()
    assert inp.prompt_token_ids and all(0 <= t < 258 for t in inp.prompt_token_ids)
    assert len(inp.prompt_token_ids) + inp.params.max_tokens <= MAX_MODEL_LEN
    assert 0 < len(inp.request_id) <= MAX_REQUEST_ID_CHARS


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=generate_requests())
def test_fuzz_through_grpc(server, channel, request):
    stub = server.stub(channel)
    try:
        responses = list(stub.Generate(request, timeout=10))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert e.details()
        event("rejected")
        return
    event("served")
    assert responses[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert sum(len(r.token_ids) for r in responses) == responses[-1].usage.completion_tokens
