"""Speculative decoding in the engine: greedy output token for token what the same engine gives
without speculation (continuous batching, chunked prefill, preemption, n > 1, stop strings,
min_tokens, logprobs, sliding window, the trained pydoc model); the rejected tokens' KV rolled
back (no block left, no hash of a rejected token in the prefix cache); seeded sampling reproducible."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.kv_cache.block_manager import prompt_block_hashes
from engine.model.presets import TRAINED
from engine.spec.config import SpecConfig
from window_support import WINDOW, one_thread, write_window_model

NGRAM = SpecConfig("ngram", num_tokens=4, adaptive=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


def _looping_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts with a repeated span in each: proposals that are sometimes right, sometimes wrong."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        span = torch.randint(2, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        head = torch.randint(2, vocab, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        prompts.append(head + span + head[-3:] + span)
    return prompts


def _staggered(engine: Engine, prompts, params_list) -> dict[int, list]:
    """Add one request per step while the batch runs; every output of each request, in order."""
    pending = list(enumerate(zip(prompts, params_list)))
    ids: dict[str, int] = {}
    results: dict[int, list] = {}
    while pending or engine.has_unfinished():
        if pending:
            i, (p, prm) = pending.pop(0)
            ids[engine.add_request(p, prm)] = i
        for out in engine.step():
            results.setdefault((ids[out.request_id], out.index), []).append(out)
    return results


def _tokens(results) -> dict:
    return {key: [t for out in outs for t in out.new_token_ids] for key, outs in results.items()}


def _engines(model_dir: str, spec: SpecConfig = NGRAM, **kw) -> tuple[Engine, Engine]:
    kw = {"dtype": "float32", "num_blocks": 512, **kw}
    return Engine(EngineArgs(model_dir, **kw)), Engine(EngineArgs(model_dir, speculative=spec, **kw))


def _assert_speculated(engine: Engine) -> None:
    """Proposals were made, and some accepted and some rejected: the paths under test ran."""
    spec = engine.speculator
    assert 0 < spec.num_accepted < spec.num_proposed, (spec.num_accepted, spec.num_proposed)


def _check_prefix_cache(engine: Engine, sequences: list[list[int]]) -> None:
    """Every hash in the prefix cache is the chained hash of a full block of some final sequence:
    no block holding a rejected proposal was ever registered."""
    valid = {h for ids in sequences for h in prompt_block_hashes(ids, engine.block_size)}
    assert engine.block_manager.cached and set(engine.block_manager.cached) <= valid


@pytest.mark.parametrize("chunk_size, budget, num_blocks", [(None, 2048, 512), (16, 64, 512), (32, 128, 20)],
                         ids=["batching", "chunked", "preemption"])
def test_greedy_equals_no_speculation(tiny_model_dir, chunk_size, budget, num_blocks):
    prompts = _looping_prompts(12, 1024)
    params = [SamplingParams(max_tokens=10 + (i * 7) % 40, temperature=0.0, ignore_eos=True) for i in range(12)]
    base, spec = _engines(tiny_model_dir, chunk_size=chunk_size, max_num_batched_tokens=budget, num_blocks=num_blocks)
    expected = _tokens(_staggered(base, prompts, params))
    got = _tokens(_staggered(spec, prompts, params))
    assert got == expected
    _assert_speculated(spec)
    if num_blocks == 20:
        assert spec.scheduler.num_preemptions > 0
    spec.block_manager.check_no_leaks()
    _check_prefix_cache(spec, [prompts[i] + got[(i, 0)] for i in range(12)])


def test_n_stop_strings_min_tokens_and_logprobs_equal_no_speculation(tiny_model_dir):
    base, spec = _engines(tiny_model_dir)
    prompts = _looping_prompts(6, 1024, seed=1)
    free = base.generate(prompts[:1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 2]          # a stop string the output contains
    params = [SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]),
              SamplingParams(max_tokens=24, temperature=0.0, n=3, repetition_penalty=1.3),
              SamplingParams(max_tokens=20, temperature=0.0, min_tokens=12, logprobs=3),
              SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=list(range(2, 40)), min_tokens=5),
              SamplingParams(max_tokens=25, temperature=0.0, logprobs=2, frequency_penalty=0.5),
              SamplingParams(max_tokens=1, temperature=0.0)]
    expected = base.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [(c.token_ids, c.text, c.finish_reason, c.matched_stop) for c in got] == \
        [(c.token_ids, c.text, c.finish_reason, c.matched_stop) for c in expected]
    assert got[0].finish_reason == "stop" and got[0].matched_stop == stop
    for g, e in zip(got, expected):
        assert (g.logprobs is None) == (e.logprobs is None)
        if g.logprobs is not None:
            assert len(g.logprobs) == len(g.token_ids)
            assert [lp.token_id for lp in g.logprobs] == g.token_ids
            torch.testing.assert_close([lp.logprob for lp in g.logprobs], [lp.logprob for lp in e.logprobs],
                                       atol=1e-4, rtol=1e-4)
            assert [[t.token_id for t in lp.top] for lp in g.logprobs] == \
                [[t.token_id for t in lp.top] for lp in e.logprobs]
    _assert_speculated(spec)
    spec.block_manager.check_no_leaks()


def test_sliding_window_greedy_equals_no_speculation(tmp_path):
    model_dir = write_window_model(str(tmp_path / "window"))
    base, spec = _engines(model_dir, block_size=4, num_blocks=160, attention="eager")
    prompts = _looping_prompts(4, 256, seed=2)
    params = SamplingParams(max_tokens=3 * WINDOW, temperature=0.0, ignore_eos=True)
    expected = [c.token_ids for c in base.generate(prompts, params)]
    assert [c.token_ids for c in spec.generate(prompts, params)] == expected
    _assert_speculated(spec)
    spec.block_manager.check_no_leaks()


def test_pydoc_greedy_equals_no_speculation():
    base, spec = _engines(TRAINED["pydoc"], num_blocks=256)
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    prompts = [code + "def add(", "The function returns", code + "def sub(a, b):\n"]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    expected = [(c.token_ids, c.text) for c in base.generate(prompts, params)]
    assert [(c.token_ids, c.text) for c in spec.generate(prompts, params)] == expected
    assert spec.speculator.num_accepted > 0
    spec.block_manager.check_no_leaks()


def test_seeded_sampling_is_reproducible_alone_and_batched(tiny_model_dir):
    _, spec = _engines(tiny_model_dir)
    prompts = _looping_prompts(5, 1024, seed=3)
    params = [SamplingParams(max_tokens=24, temperature=0.05 + 0.3 * (i % 2), seed=100 + i, ignore_eos=True)
              for i in range(5)]
    alone = [spec.generate([p], prm)[0].token_ids for p, prm in zip(prompts, params)]
    batched = _tokens(_staggered(spec, prompts, params))
    assert [batched[(i, 0)] for i in range(5)] == alone
    assert spec.speculator.num_accepted > 0
    spec.block_manager.check_no_leaks()


def test_settle_frees_the_rejected_tail_blocks(tiny_model_dir):
    """A decoding sequence at a block boundary proposes 4 tokens: the step takes a block for them;
    with none accepted it goes back, and the sequence holds exactly the blocks of its tokens."""
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=16, block_size=4,
                               speculative=NGRAM))
    rid = engine.add_request(list(range(2, 10)) + [11], SamplingParams(max_tokens=8, temperature=0.0,
                                                                      ignore_eos=True))
    engine.speculator.propose = lambda running: None           # proposals set by hand below
    engine.step()                                              # the prompt (9 tokens: 3 blocks)
    req = engine.requests[rid]
    assert req.num_computed_tokens == 9 and len(req.block_table) == 3
    before = list(req.block_table)
    target = engine.runner.score(req.all_token_ids, req.block_table)[-1].argmax().item()
    req.spec_token_ids = [(target + 1) % engine.vocab_size] * 4      # the first proposal is already wrong
    engine.step()                             # 5 query tokens at positions 9..13: a 4th block was taken
    assert req.output_token_ids[1] == target and len(req.output_token_ids) == 2
    assert req.num_computed_tokens == 10 and req.block_table == before      # and went back
    assert engine.speculator.num_proposed == 4 and engine.speculator.num_accepted == 0
    assert engine.block_manager.num_used_blocks == len(req.block_table)
    engine.abort(rid)
    engine.block_manager.check_no_leaks()


def test_adaptive_k_keeps_greedy_output(tiny_model_dir):
    """k chosen per step from measured throughput (0 included): the tokens do not change."""
    base, spec = _engines(tiny_model_dir, SpecConfig("ngram", num_tokens=3))
    prompts = _looping_prompts(10, 1024, seed=4)
    params = [SamplingParams(max_tokens=12 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(10)]
    assert _tokens(_staggered(spec, prompts, params)) == _tokens(_staggered(base, prompts, params))
    assert len({k for _, k in spec.speculator.turn_down.samples}) == 4        # every k in 0..3 was run
    spec.block_manager.check_no_leaks()


def test_an_int8_cache_keeps_greedy_output_and_fp8_is_refused(tiny_model_dir):
    base, spec = _engines(tiny_model_dir, num_blocks=256, kv_cache_dtype="int8")
    prompts = _looping_prompts(5, 1024, seed=7)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected = [c.token_ids for c in base.generate(prompts, params)]
    assert [c.token_ids for c in spec.generate(prompts, params)] == expected
    _assert_speculated(spec)
    spec.block_manager.check_no_leaks()
    with pytest.raises(ValueError, match="speculative.method: cannot run with kv_cache_dtype fp8"):
        Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64, kv_cache_dtype="fp8", speculative=NGRAM))


def test_flex_attention_and_decode_graphs_keep_greedy_output(tiny_model_dir):
    """The flex kernel's path (CUDA's default; its reference math here) reads the 1 + k tokens as a prefill
    part; with decode graphs, speculative steps run outside the graphs and plain decode steps inside."""
    base, spec = _engines(tiny_model_dir, num_blocks=128, attention="flex-eager", cuda_graphs=True)
    prompts = _looping_prompts(3, 1024, seed=9)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [c.token_ids for c in base.generate(prompts, params)]
    assert [c.token_ids for c in spec.generate(prompts, params)] == expected
    _assert_speculated(spec)
    spec.block_manager.check_no_leaks()


def test_constrained_requests_are_speculated_within_their_grammar(tiny_model_dir):
    """JSON-schema requests take proposals too: each row is judged under the grammar's mask after the
    tokens before it, so greedy output equals no speculation, a seeded one repeats, and every document
    validates (the matcher consumed only the tokens kept)."""
    import json

    import jsonschema

    from engine.sampling.structured import StructuredOutput
    schema = {"type": "object", "additionalProperties": False, "required": ["tags"],
              "properties": {"tags": {"type": "array", "maxItems": 3, "items": {"enum": ["ab", "cd"]}}}}
    spec = StructuredOutput(json_schema=json.dumps(schema))
    plain, speculative = _engines(tiny_model_dir, attention="eager")
    prompts = _looping_prompts(4, 250, seed=9)
    greedy = SamplingParams(max_tokens=200, temperature=0.0, structured=spec)
    want = [c.token_ids for c in plain.generate(prompts, greedy)]
    got = speculative.generate(prompts, greedy)
    assert [c.token_ids for c in got] == want
    _assert_speculated(speculative)
    seeded = [SamplingParams(max_tokens=200, temperature=0.8, seed=i, structured=spec) for i in range(4)]
    first = speculative.generate(prompts, seeded)
    assert [c.token_ids for c in speculative.generate(prompts, seeded)] == [c.token_ids for c in first]
    for c in got + first:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    speculative.block_manager.check_no_leaks()
