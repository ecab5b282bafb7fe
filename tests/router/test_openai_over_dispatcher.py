"""Both front doors over the real `Dispatcher` (fake prefill/decode actors from fake_actors.py, no Ray):
n sequences, logprobs, best_of selection and usage arrive as the Dispatcher produces them."""
from __future__ import annotations

import grpc
import openai
import pytest
from fake_actors import expected_tokens, fake_cluster, text_of
from openai_support import SpecialByteTokenizer

from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router import build_request, start_server
from router.dispatcher import Dispatcher
from router.routing import RoutingSettings

PROMPT = "Hello"


@pytest.fixture(params=[False, True], ids=["disaggregated", "local-prefill"])
def running(request, loop_thread, wait_until):
    cluster = fake_cluster()
    dispatcher = Dispatcher(cluster.pools, tokenizer=SpecialByteTokenizer(), max_model_len=256, block_size=4,
                            routing=RoutingSettings(max_queue=8, stream_idle_s=2.0,
                                                    local_prefill_tokens=64 if request.param else 0))
    server = loop_thread.run(start_server(dispatcher, http_port=0, model_name="fake", ready_poll_s=0.01))
    assert loop_thread.run(server.wait_ready(5.0))
    yield server, cluster
    loop_thread.run(server.stop(0))
    assert server.core.num_in_flight == 0
    for view in cluster.pools.decode:          # nothing left reserved on any actor
        wait_until(lambda: (view.reserved_blocks, view.running) == (0, 0))


def _prompt_ids() -> list[int]:
    return SpecialByteTokenizer().encode(PROMPT)


def test_completions_n_with_logprobs(running):
    server, _ = running
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        out = client.completions.create(model="fake", prompt=PROMPT, n=3, max_tokens=5, logprobs=1)
    for j, choice in enumerate(out.choices):
        tokens = expected_tokens(_prompt_ids(), 5, j)
        assert choice.index == j and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == [pytest.approx(-t / 100) for t in tokens]
        assert choice.text == "".join(text_of(t) for t in tokens)
    assert out.usage.completion_tokens == 15 and out.usage.prompt_tokens == len(_prompt_ids())


def test_chat_stream_and_grpc_best_of(running):
    server, _ = running
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        chunks = list(client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "Hi"}],
                                                     n=2, max_tokens=4, stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(len(t) == 4 for t in texts.values()) and texts[0] != texts[1]
    # best_of 3, n 1: the sequence with the highest summed logprob (lowest token ids) wins
    with grpc.insecure_channel(server.address) as channel:
        [response] = list(pb_grpc.GenerationServiceStub(channel).Generate(
            build_request(PROMPT, n=1, best_of=3, max_tokens=4), timeout=10))
    candidates = [expected_tokens(_prompt_ids(), 4, j) for j in range(3)]
    assert list(response.token_ids) == max(candidates, key=lambda ts: -sum(ts))
    assert response.index == 0 and len(response.logprobs) == 0
    assert response.usage.completion_tokens == 12
