"""Generate streams one message per backend chunk; GetStats reports the backend's load."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router import AsyncGenerationClient, BackendError, build_request, generate, get_stats


def _collect(channel, request):
    return list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=10))


def test_stream_text_deltas_concatenate_and_token_ids_match(server, channel):
    prompt = "héllo wörld ✓"
    responses = _collect(channel, build_request(prompt, max_tokens=20, request_id="r1"))
    prompt_ids = list(prompt.encode())
    expected_ids = server.backend.expected_token_ids(prompt_ids, 20)
    assert len(responses) == 20  # one message per chunk
    assert [t for r in responses for t in r.token_ids] == expected_ids
    text = "".join(r.text for r in responses)
    assert text == bytes(expected_ids).decode("utf-8", errors="replace")
    assert all(r.request_id == "r1" for r in responses)


def test_multibyte_characters_are_never_split(server, channel):
    # the fake emits the prompt's bytes reversed: one byte per message
    prompt_ids = list("✓é".encode())[::-1]
    responses = _collect(channel, build_request(token_ids=prompt_ids, max_tokens=5))
    assert [r.text for r in responses] == ["", "", "✓", "", "é"]
    assert [len(r.token_ids) for r in responses] == [1] * 5


def test_usage_and_timing_only_on_last_message(server, channel):
    responses = _collect(channel, build_request("abcdef", max_tokens=4))
    *body, last = responses
    for r in body:
        assert r.finish_reason == pb.FINISH_REASON_UNSPECIFIED
        assert not r.HasField("usage") and not r.HasField("timing")
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens) == (6, 4, 0)
    assert last.timing.queue_s == pytest.approx(0.001)
    assert last.timing.kv_transfer_s == pytest.approx(0.003)
    assert last.timing.decode_queue_s == pytest.approx(0.004)
    assert 0 < last.timing.ttft_s <= last.timing.e2e_s < 10


def test_stop_string_and_defaults(server, channel):
    responses = _collect(channel, build_request("xyzab", max_tokens=10, stop=["zy"]))
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    assert "".join(r.text for r in responses) == "bazy"
    inp = next(iter(server.backend.inputs.values()))
    assert inp.params.stop == ("zy",)
    # unset sampling fields take the engine defaults
    assert (inp.params.temperature, inp.params.top_p, inp.params.top_k, inp.params.seed) == (1.0, 1.0, 0, None)


def test_eos_finishes_with_stop_unless_ignore_eos(server, channel):
    eos = server.backend.tokenizer.eos_token_id
    stopped = _collect(channel, build_request(token_ids=[eos, 65, 66], max_tokens=8))
    assert [t for r in stopped for t in r.token_ids] == [66, 65, eos]
    assert stopped[-1].finish_reason == pb.FINISH_REASON_STOP
    ignored = _collect(channel, build_request(token_ids=[eos, 65, 66], max_tokens=8, ignore_eos=True))
    assert sum(len(r.token_ids) for r in ignored) == 8
    assert ignored[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_default_max_tokens_is_16_and_request_id_generated(server, channel):
    responses = _collect(channel, pb.GenerateRequest(prompt="abc"))
    assert sum(len(r.token_ids) for r in responses) == 16
    rid = responses[0].request_id
    assert len(rid) == 32 and all(r.request_id == rid for r in responses)


def test_sampling_fields_reach_the_backend(server, channel):
    request = build_request(
        "abc", max_tokens=3, temperature=0.5, top_p=0.9, top_k=7, repetition_penalty=1.1,
        frequency_penalty=-0.5, presence_penalty=0.25, seed=2**63, stop=["q"], request_id="s",
    )
    _collect(channel, request)
    p = server.backend.inputs["s"].params
    assert (p.max_tokens, p.top_k, p.seed, p.stop) == (3, 7, 2**63, ("q",))
    assert (p.temperature, p.top_p, p.repetition_penalty) == pytest.approx((0.5, 0.9, 1.1))
    assert (p.frequency_penalty, p.presence_penalty) == pytest.approx((-0.5, 0.25))
    assert server.backend.inputs["s"].deadline is not None  # timeout=10 became a deadline


@pytest.mark.parametrize("code", ["RESOURCE_EXHAUSTED", "UNAVAILABLE", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED"])
def test_backend_error_maps_to_status(serve, code):
    running = serve()
    running.backend.fail_with = BackendError(code, f"backend says {code.lower()}")
    with pytest.raises(grpc.RpcError) as e:
        list(generate(running.address, "abc", timeout=10))
    assert e.value.code() == grpc.StatusCode[code]
    assert e.value.details() == f"backend says {code.lower()}"
    running.backend.fail_with = None
    assert list(generate(running.address, "abc", max_tokens=2, timeout=10))[-1].finish_reason


def test_stream_without_finish_reason_is_internal(serve, make_backend):
    backend = make_backend()
    backend.no_finish = True
    running = serve(backend)
    with pytest.raises(grpc.RpcError) as e:
        list(generate(running.address, "abc", max_tokens=3, timeout=10))
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "finish reason" in e.value.details()


def test_get_stats_per_actor_and_totals(server):
    stats = get_stats(server.address, timeout=10)
    assert [(a.actor_id, a.role) for a in stats.actors] == [
        ("prefill-0", pb.ACTOR_ROLE_PREFILL), ("decode-0", pb.ACTOR_ROLE_DECODE),
    ]
    t = stats.totals
    assert (t.num_prefill_actors, t.num_decode_actors, t.num_colocated_actors) == (1, 1, 0)
    assert (t.kv_blocks_total, t.kv_blocks_used, t.queued_requests, t.running_requests) == (192, 3, 1, 0)
    assert stats.router_in_flight_requests == 0


def test_async_client_concurrent_requests(server):
    async def run() -> list[str]:
        async with AsyncGenerationClient(server.address) as client:
            async def one(i: int) -> str:
                return "".join([r.text async for r in client.generate(f"req{i:02d}", max_tokens=5, timeout=10)])

            return await asyncio.gather(*(one(i) for i in range(16)))

    texts = asyncio.run(run())
    assert texts == [f"req{i:02d}"[::-1] for i in range(16)]
    assert len(server.backend.finished) == 16


def test_long_prompt_is_tokenized_off_the_loop(serve, make_backend):
    running = serve(make_backend(max_model_len=10_000))
    responses = list(generate(running.address, "a" * 8999 + "z", max_tokens=2, timeout=10))
    assert "".join(r.text for r in responses) == "za"
    assert responses[-1].usage.prompt_tokens == 9000
    with pytest.raises(grpc.RpcError) as e:
        list(generate(running.address, "b" * 9999, max_tokens=2, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "9999 tokens" in e.value.details()


def test_get_stats_failure_is_a_clear_status(server, monkeypatch):
    async def broken() -> list:
        raise RuntimeError("actor died")

    monkeypatch.setattr(server.backend, "stats", broken)
    with pytest.raises(grpc.RpcError) as e:
        get_stats(server.address, timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "stats" in e.value.details()
    monkeypatch.setattr(server.backend, "stats", lambda: _raise(BackendError("UNAVAILABLE", "no decode actors")))
    with pytest.raises(grpc.RpcError) as e:
        get_stats(server.address, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "no decode actors"


async def _raise(error: Exception) -> list:
    raise error


def test_tokenizer_crash_is_internal_and_server_keeps_serving(server, monkeypatch):
    def broken(text: str) -> list[int]:
        raise RuntimeError("tokenizer bug")

    monkeypatch.setattr(server.backend.tokenizer, "encode", broken)
    with pytest.raises(grpc.RpcError) as e:
        list(generate(server.address, "abc", timeout=10))
    assert e.value.code() == grpc.StatusCode.INTERNAL and "validating" in e.value.details()
    monkeypatch.undo()
    assert list(generate(server.address, "abc", max_tokens=1, timeout=10))[-1].finish_reason
