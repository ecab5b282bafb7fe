"""Streaming, conditional disaggregation, prefix cache, cancellation and bad input on one cluster."""
from __future__ import annotations

import threading

import grpc
import pytest

from engine import SamplingParams
from proto.pdserve.v1 import generation_pb2 as pb
from router.client import generate

from cluster_helpers import ClusterThread, cluster_config, prompts_and_params, wait_blocks_free

LOCAL_PREFILL = 8


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model_dir):
    c = ClusterThread(cluster_config(tiny_model_dir, "grpc", "none", local_prefill_tokens=LOCAL_PREFILL))
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "cluster" in request.fixturenames:
        stats = wait_blocks_free(request.getfixturevalue("cluster").address)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats


def _greedy(ids, n):
    return dict(token_ids=ids, max_tokens=n, temperature=0.0, ignore_eos=True)


def test_streaming_deltas_concatenate_to_final_text(cluster, reference, tiny_model_dir):
    from engine.tokenizer import Tokenizer
    tok = Tokenizer(tiny_model_dir)
    prompt = "Stream me some text, 你好世界"
    msgs = list(generate(cluster.address, prompt, max_tokens=40, temperature=0.0, ignore_eos=True))
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == reference([tok.encode(prompt)], [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)])[0]
    assert "".join(m.text for m in msgs) == tok.decode(ids)
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    assert msgs[-1].usage.completion_tokens == 40 and msgs[-1].timing.ttft_s > 0


def test_conditional_disaggregation_prefills_short_prompts_on_decode(cluster, reference):
    short, long_ = [5, 6, 7], list(range(2, 90))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = reference([short, long_], [params, params])
    local = list(generate(cluster.address, **_greedy(short, 12)))
    remote = list(generate(cluster.address, **_greedy(long_, 12)))
    assert [t for m in local for t in m.token_ids] == expected[0]
    assert [t for m in remote for t in m.token_ids] == expected[1]
    assert local[-1].timing.kv_transfer_s == 0.0 and local[-1].timing.prefill_s == 0.0
    assert remote[-1].timing.kv_transfer_s > 0.0


def test_prefix_cache_hits_reported_and_output_identical(cluster, reference):
    system = list(range(300, 300 + 80))               # 5 full blocks
    a, b = system + [11, 12, 13], system + [21, 22]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = reference([a, b], [params, params])
    first = list(generate(cluster.address, **_greedy(a, 10)))
    second = list(generate(cluster.address, **_greedy(b, 10)))
    assert [t for m in first for t in m.token_ids] == expected[0]
    assert [t for m in second for t in m.token_ids] == expected[1]
    assert second[-1].usage.cached_prompt_tokens == 80


def test_cancel_half_of_twenty_streams_frees_every_block(cluster, reference):
    prompts, _ = prompts_and_params(20, seed=21, max_len=200)
    prompts[1] = prompts[1][:100]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = reference(prompts, [params] * 20)
    results: dict[int, list] = {}

    def run(i):   # odd requests ask for many tokens and are cancelled after 3 messages
        call = generate(cluster.address, **_greedy(prompts[i], 1500 if i % 2 else 60))
        got = []
        try:
            for msg in call:
                got.append(msg)
                if i % 2 and len(got) == 3:
                    call.close()               # cancels the RPC mid-stream
                    break
        finally:
            results[i] = got
    threads = [threading.Thread(target=run, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(0, 20, 2):
        assert [t for m in results[i] for t in m.token_ids] == expected[i]
    for i in range(1, 20, 2):
        assert len(results[i]) == 3 and not results[i][-1].finish_reason
    # the service still serves afterwards
    again = list(generate(cluster.address, **_greedy(prompts[1], 60)))
    assert [t for m in again for t in m.token_ids] == expected[1]


@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt=""), "prompt"),
    (dict(token_ids=[5, 10 ** 6]), "token_ids"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=10 ** 6), "max_tokens"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", top_p=2.0), "top_p"),
])
def test_bad_requests_invalid_argument_and_still_serving(cluster, kwargs, field):
    with pytest.raises(grpc.RpcError) as err:
        list(generate(cluster.address, **kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert list(generate(cluster.address, "still here", max_tokens=2))[-1].finish_reason


def test_first_token_completing_a_stop_string_is_cut_as_colocated(cluster, tiny_model_dir):
    """A request that ends at its first token because that token completes a stop
    string gets the text the colocated engine emits ("" here), not the token's text."""
    from engine import Engine, EngineArgs
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64))
    for start in range(20, 300):               # longer than LOCAL_PREFILL: prefilled remotely
        prompt = list(range(start, start + 2 * LOCAL_PREFILL))
        [first] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids
        stop = engine.tokenizer.decode([first])
        if stop.strip() and "\ufffd" not in stop:
            break
    [want] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop=(stop,)))
    assert want.finish_reason == "stop" and want.token_ids == [first]
    msgs = list(generate(cluster.address, token_ids=prompt, max_tokens=8, temperature=0.0, stop=[stop]))
    assert [t for m in msgs for t in m.token_ids] == [first]
    assert "".join(m.text for m in msgs) == want.text == ""
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
