"""End to end on Ray clusters, every sampling and output field gives identical responses
disaggregated (1 prefill + 1 decode actor, codec none, every prompt prefilled remotely) and colocated,
and greedy logprobs / prompt logprobs equal HF transformers' log-softmax on the same checkpoint."""
from __future__ import annotations

import pytest
import torch

from proto.pdserve.v1 import generation_pb2 as pb
from router.client import generate

from cluster_helpers import ClusterThread, cluster_config, wait_blocks_free

PROMPT = list(range(5, 46))          # 41 tokens: two full 16-token blocks and a partial one


@pytest.fixture(scope="module")
def clusters(ray_local, tiny_model_dir):
    disaggregated = ClusterThread(cluster_config(tiny_model_dir, "grpc", "none"))
    colocated = ClusterThread(cluster_config(tiny_model_dir, "grpc", "none"), mode="colocated")
    yield {"disaggregated": disaggregated, "colocated": colocated}
    disaggregated.stop()
    colocated.stop()


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    """Log-softmax of HF transformers' logits at every position of a token sequence (float32)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)
    return run


def _summary(messages: list[pb.GenerateResponse]) -> dict:
    """Everything a client sees, per sequence (timings aside)."""
    seqs: dict[int, dict] = {}
    for m in messages:
        s = seqs.setdefault(m.index, {"tokens": [], "text": "", "logprobs": [], "finish": 0, "stop": None})
        s["tokens"] += list(m.token_ids)
        s["text"] += m.text
        s["logprobs"] += [(lp.token_id, round(lp.logprob, 4), [t.token_id for t in lp.top]) for lp in m.logprobs]
        if m.finish_reason:
            which = m.WhichOneof("matched_stop")
            s["finish"], s["stop"] = m.finish_reason, getattr(m, which) if which else None
    last = messages[-1]
    prompt_logprobs = [(lp.token_id, round(lp.logprob, 4)) for m in messages for lp in m.prompt_logprobs]
    return {"sequences": seqs, "prompt_logprobs": prompt_logprobs,
            "usage": (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens)}


def _both(clusters, prompt=PROMPT, **sampling) -> tuple[dict, list[pb.GenerateResponse]]:
    """The summary, asserted equal on both clusters; and the disaggregated messages."""
    got = {mode: list(generate(c.address, token_ids=prompt, **sampling)) for mode, c in clusters.items()}
    summaries = {mode: _summary(msgs) for mode, msgs in got.items()}
    assert summaries["disaggregated"] == summaries["colocated"]
    for c in clusters.values():
        stats = wait_blocks_free(c.address)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    return summaries["disaggregated"], got["disaggregated"]


def test_greedy_logprobs_and_prompt_logprobs_equal_hf(clusters, hf_logprobs):
    prompt = list(range(60, 101))
    summary, messages = _both(clusters, prompt, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5,
                              prompt_logprobs=3)
    tokens = summary["sequences"][0]["tokens"]
    ref = hf_logprobs(prompt + tokens)
    got = [lp for m in messages for lp in m.logprobs]
    assert [lp.token_id for lp in got] == tokens
    for i, lp in enumerate(got):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[lp.token_id].item()) <= 1e-4
        top = row.topk(5)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        assert max(abs(t.logprob - v) for t, v in zip(lp.top, top.values.tolist())) <= 1e-4
    prompt_lps = messages[0].prompt_logprobs
    assert [lp.token_id for lp in prompt_lps] == prompt[1:]
    for i, lp in enumerate(prompt_lps):
        assert abs(lp.logprob - ref[i][prompt[i + 1]].item()) <= 1e-4
        assert [t.token_id for t in lp.top] == ref[i].topk(3).indices.tolist()


def test_n_sequences_are_reproducible_and_distinct(clusters):
    summary, _ = _both(clusters, max_tokens=8, temperature=1.0, seed=1234, n=4, logprobs=0, ignore_eos=True)
    seqs = summary["sequences"]
    assert sorted(seqs) == [0, 1, 2, 3] and all(len(s["tokens"]) == 8 for s in seqs.values())
    assert len({tuple(s["tokens"]) for s in seqs.values()}) > 1
    assert summary["usage"][1] == 32
    again, _ = _both(clusters, max_tokens=8, temperature=1.0, seed=1234, n=4, logprobs=0, ignore_eos=True)
    assert again["sequences"] == seqs


def test_best_of_returns_the_most_likely_sequence(clusters):
    summary, _ = _both(clusters, max_tokens=6, temperature=1.0, seed=77, n=1, best_of=4, ignore_eos=True)
    assert sorted(summary["sequences"]) == [0] and len(summary["sequences"][0]["tokens"]) == 6
    assert summary["sequences"][0]["logprobs"] == []          # not asked for: stripped


def test_stop_token_ids_min_tokens_and_matched_stop(clusters):
    sampled = dict(max_tokens=10, temperature=1.0, seed=21, ignore_eos=True)
    probe, _ = _both(clusters, **sampled)
    tokens = probe["sequences"][0]["tokens"]
    stop_id = next(t for t in tokens[3:] if t not in tokens[:3])
    summary, _ = _both(clusters, **sampled, stop_token_ids=[stop_id])
    seq = summary["sequences"][0]
    assert seq["tokens"] == tokens[:tokens.index(stop_id) + 1]
    assert (seq["finish"], seq["stop"]) == (pb.FINISH_REASON_STOP, stop_id)
    held, _ = _both(clusters, **sampled, stop_token_ids=[tokens[0]], min_tokens=4)
    got = held["sequences"][0]["tokens"]
    assert len(got) >= 4 and tokens[0] not in got[:4]        # masked until 4 tokens, then it may end the sequence
    assert tokens[0] not in got[4:-1]


def test_logit_bias_and_min_p(clusters):
    summary, _ = _both(clusters, max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias={77: 100.0})
    assert summary["sequences"][0]["tokens"] == [77] * 5
    sampled, _ = _both(clusters, max_tokens=6, temperature=1.0, seed=9, min_p=0.2, ignore_eos=True)
    assert len(sampled["sequences"][0]["tokens"]) == 6


def test_cached_tokens_on_a_prefix_hit(clusters):
    prompt = list(range(120, 161))
    first, _ = _both(clusters, prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
    second, _ = _both(clusters, prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
    assert first["usage"][2] == 0 and second["usage"][2] == 32     # two full blocks served from the cache


def test_the_openai_client_gets_what_grpc_gets(clusters):
    """The official client against each cluster's HTTP API: same text and logprobs as gRPC, chat streaming
    with usage, n choices."""
    from openai import OpenAI
    for mode, c in clusters.items():
        client = OpenAI(base_url=c.cluster.http_url, api_key="unused", max_retries=0)
        [model] = [m.id for m in client.models.list().data]
        grpc_msgs = list(generate(c.address, token_ids=PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True,
                                  logprobs=2))
        resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=2,
                                         extra_body={"ignore_eos": True})
        [choice] = resp.choices
        assert choice.text == "".join(m.text for m in grpc_msgs), mode
        grpc_logprobs = [lp.logprob for m in grpc_msgs for lp in m.logprobs]
        assert choice.logprobs.token_logprobs == pytest.approx(grpc_logprobs, abs=1e-6), mode
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(PROMPT), 6)
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello there"}],
                                                max_tokens=5, temperature=0.0, n=2, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        texts, finishes, usage = {0: "", 1: ""}, {}, None
        for chunk in stream:
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
                if ch.finish_reason:
                    finishes[ch.index] = ch.finish_reason
            usage = chunk.usage or usage
        assert finishes == {0: "length", 1: "length"} and texts[0] == texts[1], mode   # greedy: alike
        assert usage is not None and usage.completion_tokens == 10, mode


def test_a_constrained_request_is_the_same_disaggregated_and_colocated(clusters):
    """A JSON-schema request crosses the handoff (the prefill actor's first token under the mask, the decode
    actor's matcher replaying it): the same tokens as colocated, and the document validates; the HTTP door's
    response_format gets the same text."""
    import json

    import jsonschema
    from openai import OpenAI

    from engine.sampling.structured import StructuredOutput
    schema = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                             "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}}}
    spec = StructuredOutput(json_schema=json.dumps(schema)).to_proto()
    summary, messages = _both(clusters, max_tokens=200, temperature=0.7, seed=5, structured=spec)
    text = summary["sequences"][0]["text"]
    assert summary["sequences"][0]["finish"] == pb.FINISH_REASON_STOP
    jsonschema.validate(json.loads(text), schema)
    client = OpenAI(base_url=clusters["disaggregated"].cluster.http_url, api_key="unused", max_retries=0)
    [model] = [m.id for m in client.models.list().data]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=200, temperature=0.7, seed=5,
                                    extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                        "name": "record", "schema": schema}}})
    assert out.choices[0].text == text
