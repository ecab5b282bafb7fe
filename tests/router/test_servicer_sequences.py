"""gRPC Generate with n / best_of sequences: index, logprobs, prompt_logprobs, matched stop, usage on the
request's last message, best_of selection — over `ScriptedBackend` (tests/router/openai_support.py)."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from openai_support import EOS, REPLIES, SEQ_LOGPROBS, ScriptedBackend

from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router import BackendError, GenerationChunk, Usage, build_request
from router.best_of import select_best


def _generate(running, **sampling) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(running.address) as channel:
        request = build_request("Hi", user="carol", **sampling)
        return list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=10))


def _by_index(responses):
    out: dict[int, list[pb.GenerateResponse]] = {}
    for r in responses:
        out.setdefault(r.index, []).append(r)
    return out


def test_n_sequences_interleave_and_usage_comes_last(serve):
    running = serve(ScriptedBackend())
    responses = _generate(running, n=3, max_tokens=40)
    indices = [r.index for r in responses]
    assert indices[:3] == [0, 1, 2]                           # interleaved, as the backend sent them
    by_index = _by_index(responses)
    for i in range(3):
        assert "".join(r.text for r in by_index[i]) == REPLIES[i]
        assert by_index[i][-1].finish_reason == pb.FINISH_REASON_STOP
        assert by_index[i][-1].stop_token_id == EOS
    *body, last = responses
    assert all(not r.HasField("usage") and not r.HasField("timing") for r in body)
    assert last.usage.completion_tokens == sum(len(REPLIES[i]) + 1 for i in range(3))
    assert last.usage.prompt_tokens == 3 and last.usage.cached_prompt_tokens == 2
    assert 0 < last.timing.ttft_s <= last.timing.e2e_s


def test_logprobs_prompt_logprobs_and_matched_stop_string(serve):
    running = serve(ScriptedBackend())
    responses = _generate(running, max_tokens=40, logprobs=2, prompt_logprobs=1, stop=["there"])
    assert [len(r.prompt_logprobs) for r in responses] == [2] + [0] * (len(responses) - 1)
    assert [lp.token_id for lp in responses[0].prompt_logprobs] == [ord("H"), ord("i")]
    for r in responses:
        assert [lp.token_id for lp in r.logprobs] == list(r.token_ids)
        assert all(lp.logprob == pytest.approx(SEQ_LOGPROBS[0]) and len(lp.top) == 2 for lp in r.logprobs)
    assert "".join(r.text for r in responses) == "Hello "
    assert responses[-1].WhichOneof("matched_stop") == "stop_str" and responses[-1].stop_str == "there"


def test_stop_token_id_and_length_leave_the_right_matched_stop(serve):
    running = serve(ScriptedBackend())
    stopped = _generate(running, max_tokens=40, stop_token_ids=[ord("l")])
    assert stopped[-1].WhichOneof("matched_stop") == "stop_token_id" and stopped[-1].stop_token_id == ord("l")
    length = _generate(running, max_tokens=2)
    assert length[-1].finish_reason == pb.FINISH_REASON_LENGTH and length[-1].WhichOneof("matched_stop") is None


def test_best_of_streams_the_best_n_at_the_end_renumbered(serve):
    running = serve(ScriptedBackend())
    responses = _generate(running, n=2, best_of=4, max_tokens=40)
    scores = sorted(range(4), key=lambda i: -SEQ_LOGPROBS[i] * (len(REPLIES[i]) + 1))
    assert [r.index for r in responses] == [0, 1]             # one merged message per kept sequence
    assert [r.text for r in responses] == [REPLIES[scores[0]], REPLIES[scores[1]]]
    assert all(len(r.logprobs) == 0 for r in responses)       # not asked for: stripped
    assert not responses[0].HasField("usage") and responses[1].usage.completion_tokens == \
        sum(len(r) + 1 for r in REPLIES)
    with_logprobs = _generate(running, n=1, best_of=2, max_tokens=40, logprobs=0)
    assert [len(r.logprobs) for r in with_logprobs] == [len(REPLIES[1]) + 1]


def test_backend_failure_mid_request_is_its_status(serve):
    backend = ScriptedBackend()
    backend.fail_with = BackendError("UNAVAILABLE", "decode actor gone")
    backend.fail_after = 4
    running = serve(backend)
    with pytest.raises(grpc.RpcError) as e:
        _generate(running, n=2, max_tokens=40)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "decode actor gone"


def test_bad_sequence_fields_name_the_field(serve):
    running = serve(ScriptedBackend())
    for sampling, words in (({"n": 2, "best_of": 1}, "sampling.best_of"), ({"n": 0}, "sampling.n must be"),
                            ({"logprobs": 21}, "sampling.logprobs"),
                            ({"stop_token_ids": [999]}, "sampling.stop_token_ids")):
        with pytest.raises(grpc.RpcError) as e:
            _generate(running, **sampling)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


def test_user_is_logged_not_a_metric_label(serve, caplog):
    from router.metrics import Metrics
    metrics = Metrics()
    running = serve(ScriptedBackend(), metrics=metrics)
    with caplog.at_level(logging.INFO, logger="pdserve.router"):
        _generate(running, n=2, max_tokens=3)
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "request_finished"]
    assert (line.fields["api"], line.fields["user"], line.fields["num_sequences"]) == ("grpc", "carol", 2)
    assert line.fields["finish_reason"] == "length,length"
    assert b"carol" not in metrics.exposition()
    assert b'pdserve_requests_total{finish_reason="length"} 1.0' in metrics.exposition()


def test_select_best_breaks_ties_by_index_and_keeps_prompt_logprobs():
    lp = pb.TokenLogprob(token_id=1, logprob=-1.0)

    async def chunks():
        yield GenerationChunk([1], "a", None, index=0, logprobs=[lp], prompt_logprobs=[lp])
        yield GenerationChunk([1], "b", pb.FINISH_REASON_STOP, index=1, logprobs=[lp], matched_stop=EOS)
        yield GenerationChunk([1], "c", pb.FINISH_REASON_LENGTH, index=2, logprobs=[lp, lp], usage=Usage(1, 4, 0))
        yield GenerationChunk([], "", pb.FINISH_REASON_STOP, index=0, matched_stop="x")

    async def run():
        return [c async for c in select_best(chunks(), 2, keep_logprobs=True)]

    first, second = asyncio.run(run())
    assert (first.index, first.text, first.finish_reason, first.matched_stop) == (0, "a", pb.FINISH_REASON_STOP, "x")
    assert (second.index, second.text, second.matched_stop) == (1, "b", EOS)
    assert first.prompt_logprobs == [lp] and second.prompt_logprobs is None
    assert first.usage is None and second.usage == Usage(1, 4, 0)
