"""n > 1: one prefill, forked sequences sharing the prompt's full blocks, each drawing with its own seed."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.sampling.sampler import child_seed

PROMPT = list(range(40, 61))          # 21 tokens: one full block of 16 and a partial one of 5


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 20, "temperature": 1.0, "seed": 17, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=256))


def _drain(engine: Engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_child_seed_keeps_sequence_zero():
    assert child_seed(17, 0) == 17
    assert len({child_seed(17, i) for i in range(64)}) == 64
    assert child_seed(17, 1) != child_seed(18, 1)


def test_each_sequence_equals_a_lone_request_with_its_child_seed(engine):
    done = engine.generate([PROMPT], _params(n=4))
    assert [c.index for c in done] == [0, 1, 2, 3] and len({c.request_id for c in done}) == 1
    again = engine.generate([PROMPT], _params(n=4))
    assert [c.token_ids for c in again] == [c.token_ids for c in done]
    for i, c in enumerate(done):
        [lone] = engine.generate([PROMPT], _params(seed=child_seed(17, i)))
        assert c.token_ids == lone.token_ids and c.text == lone.text and c.finish_reason == lone.finish_reason
    assert len({tuple(c.token_ids) for c in done}) == 4
    engine.block_manager.check_no_leaks()
    assert not engine.requests


def test_best_of_generates_best_of_sequences_with_logprobs(engine):
    done = engine.generate([PROMPT], _params(n=2, best_of=3, max_tokens=6))
    assert len(done) == 3
    for c in done:
        assert len(c.logprobs) == 6 and [e.token_id for e in c.logprobs] == c.token_ids
        assert all(len(e.top) == 0 for e in c.logprobs)
        assert c.cumulative_logprob == pytest.approx(sum(e.logprob for e in c.logprobs), abs=1e-4)


def test_fork_shares_full_blocks_and_copies_the_partial_one(engine):
    bm = engine.block_manager
    rid = engine.add_request(PROMPT, _params(n=3))
    first = engine.step()
    assert sorted(o.index for o in first) == [0, 1, 2] and all(o.request_id == rid for o in first)
    root = engine.requests[rid]
    seqs = root.sequences
    assert [s.index for s in seqs] == [0, 1, 2] and all(s.parent is root for s in seqs[1:])
    full, partial = root.block_table[0], root.block_table[1]
    assert bm.blocks[full].ref_count == 3
    copies = [s.block_table[1] for s in seqs[1:]]
    assert all(s.block_table[0] == full for s in seqs) and len({partial, *copies}) == 3
    for b in copies:
        assert bm.blocks[b].ref_count == 1
        assert torch.equal(engine.kv_cache[:, b], engine.kv_cache[:, partial])     # every layer, K and V
    # Decoding writes each sequence's own tokens into its own copy only.
    engine.step()
    rows = PROMPT.__len__() % engine.block_size
    assert not torch.equal(engine.kv_cache[:, copies[0], :, :, rows], engine.kv_cache[:, partial, :, :, rows])
    assert torch.equal(engine.kv_cache[:, copies[0], :, :, :rows], engine.kv_cache[:, partial, :, :, :rows])
    _drain(engine)
    bm.check_no_leaks()
    assert not engine.requests


def test_prompt_on_a_block_boundary_shares_every_prompt_block(engine):
    prompt = list(range(40, 72))        # 32 tokens: two full blocks, nothing to copy
    rid = engine.add_request(prompt, _params(n=2))
    engine.step()
    root = engine.requests[rid]
    child = root.sequences[1]
    assert child.block_table == root.block_table[:2]
    assert [engine.block_manager.blocks[b].ref_count for b in root.block_table] == [2, 2]
    _drain(engine)
    engine.block_manager.check_no_leaks()


def test_request_stays_until_every_sequence_finished(engine):
    # Sequence 1 draws the stop token at its third token; the others run to max_tokens.
    base = engine.generate([PROMPT], _params(n=3, max_tokens=8))
    stop = base[1].token_ids[2]
    assert stop not in base[0].token_ids + base[2].token_ids + base[1].token_ids[:2]
    rid = engine.add_request(PROMPT, _params(n=3, max_tokens=8, stop_token_ids=(stop,)))
    finished_at, step = {}, 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            if out.finish_reason:
                finished_at[out.index] = step
        if len(finished_at) < 3:
            assert rid in engine.requests and engine.requests[rid].num_prompt_tokens == len(PROMPT)
    assert finished_at == {1: 3, 0: 8, 2: 8}
    assert rid not in engine.requests
    engine.block_manager.check_no_leaks()


def test_abort_ends_every_sequence_and_frees_every_block(engine):
    rid = engine.add_request(PROMPT, _params(n=4, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 2
    out = engine.abort(rid)
    assert out.finish_reason == "abort" and out.num_output_tokens == 8
    assert not engine.has_unfinished() and rid not in engine.requests
    engine.block_manager.check_no_leaks()


def test_preempted_sequences_recompute_alone_with_their_own_seed(tiny_model_dir, engine):
    expected = [c.token_ids for c in engine.generate([PROMPT], _params(n=4, max_tokens=40))]
    # 4 sequences of 21 + 40 tokens need 1 shared + 4 x 3 blocks; 8 blocks force preemption.
    small = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=8))
    got = [c.token_ids for c in small.generate([PROMPT], _params(n=4, max_tokens=40))]
    assert small.scheduler.num_preemptions > 0
    assert got == expected
    small.block_manager.check_no_leaks()


def test_prefill_only_then_adopt_forks_on_the_decode_side(tiny_model_dir, engine):
    params = _params(n=3, max_tokens=12, logprobs=1)
    expected = engine.generate([PROMPT], params)
    prefill = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64))
    decode = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64))
    prefill.add_request(PROMPT, params, request_id="r", prefill_only=True)
    firsts = _drain(prefill)
    assert [o.index for o in firsts] == [0, 1, 2] and all(o.prefilled for o in firsts)
    assert all(o.block_ids == firsts[0].block_ids for o in firsts) and len(firsts[0].block_ids) == 2
    assert prefill.requests["r"].status.value == "prefilled"
    dst = decode.block_manager.allocate(2)
    decode.kv_cache[:, dst] = prefill.kv_cache[:, firsts[0].block_ids]
    prefill.release("r")
    prefill.block_manager.check_no_leaks()
    decode.expect_kv("r", PROMPT, params, transfer_id="t", deadline=float("inf"))
    adopted = decode.adopt("r", [o.new_token_ids[0] for o in firsts], dst,
                           first_logprobs=[o.logprobs[0] for o in firsts])
    assert [o.index for o in adopted] == [0, 1, 2]
    assert [o.logprobs[0] for o in adopted] == [o.logprobs[0] for o in firsts]
    root = decode.requests["r"]
    assert decode.block_manager.blocks[dst[0]].ref_count == 3 and root.block_table == dst
    got = {i: list(o.new_token_ids) for i, o in enumerate(adopted)}
    lps = {i: list(o.logprobs) for i, o in enumerate(adopted)}
    for out in _drain(decode):
        got[out.index] += out.new_token_ids
        lps[out.index] += out.logprobs
    assert [got[i] for i in range(3)] == [c.token_ids for c in expected]
    for i, c in enumerate(expected):
        pairs = [(e.token_id, e.top[0].token_id) for e in c.logprobs]
        assert [(e.token_id, e.top[0].token_id) for e in lps[i]] == pairs
        assert [e.logprob for e in lps[i]] == pytest.approx([e.logprob for e in c.logprobs], abs=1e-5)
    decode.block_manager.check_no_leaks()
    assert not decode.requests


def test_sequences_ending_at_their_first_token(tiny_model_dir, engine):
    """Prefill side: ended ones are reported finished, the rest prefilled; decode side: they end at adopt."""
    base = engine.generate([PROMPT], _params(n=3, max_tokens=4))
    firsts = [c.token_ids[0] for c in base]
    assert firsts[1] not in (firsts[0], firsts[2])
    params = _params(n=3, max_tokens=4, stop_token_ids=(firsts[1],))
    prefill = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64))
    prefill.add_request(PROMPT, params, request_id="r", prefill_only=True)
    outs = _drain(prefill)
    assert [(o.finish_reason, o.prefilled, o.matched_stop) for o in outs] == [
        (None, True, None), ("stop", False, firsts[1]), (None, True, None)]
    assert "r" in prefill.requests
    prefill.release("r")
    prefill.block_manager.check_no_leaks()

    decode = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64))
    decode.expect_kv("r", PROMPT, params, transfer_id="t", deadline=float("inf"))
    dst = decode.block_manager.allocate(2)        # what the blocks hold does not matter: aborted below
    adopted = decode.adopt("r", firsts, dst)
    assert [o.finish_reason for o in adopted] == [None, "stop", None]
    assert len(decode.requests["r"].sequences) == 3
    decode.abort("r")
    decode.block_manager.check_no_leaks()

    # Every sequence ends at its first token: the prefill side finishes the request and frees it.
    prefill.add_request(PROMPT, _params(n=3, max_tokens=1), request_id="s", prefill_only=True)
    outs = _drain(prefill)
    assert [(o.index, o.finish_reason, o.prefilled) for o in outs] == [(i, "length", False) for i in range(3)]
    assert "s" not in prefill.requests
    prefill.block_manager.check_no_leaks()


def test_adopt_refuses_the_wrong_number_of_first_tokens_and_takes_no_blocks(tiny_model_dir):
    decode = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=16))
    decode.expect_kv("r", PROMPT, _params(n=2), transfer_id="t", deadline=float("inf"))
    dst = decode.block_manager.allocate(2)
    for firsts in ([5], [5, 6, 7], [5, decode.vocab_size]):
        with pytest.raises(ValueError, match="first_token_ids"):
            decode.adopt("r", firsts, dst)
    assert decode.requests["r"].block_table == []
    decode.block_manager.free(dst)
    decode.abort("r")
    decode.block_manager.check_no_leaks()


def test_n_greater_than_one_cannot_resume_mid_stream(engine):
    with pytest.raises(ValueError, match="resume_output_ids"):
        engine.add_request(PROMPT, _params(n=2), resume_output_ids=[5])
    assert not engine.requests


def test_only_sequence_zero_carries_prompt_logprobs(engine):
    rid = engine.add_request(PROMPT, _params(n=3, max_tokens=3, prompt_logprobs=2))
    outs = _drain(engine)
    with_prompt = [(o.index, len(o.prompt_logprobs)) for o in outs if o.prompt_logprobs is not None]
    assert with_prompt == [(0, len(PROMPT) - 1)] and outs[0].index == 0
    assert outs[0].num_cached_tokens == 0 and rid not in engine.requests
    engine.block_manager.check_no_leaks()


def test_abort_before_the_prompt_completes(tiny_model_dir):
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64, chunk_size=8, attention="eager"))
    rid = engine.add_request(PROMPT, _params(n=4))
    assert engine.step() == []                      # 8 of 21 prompt tokens: nothing sampled, nothing forked
    assert engine.requests[rid].sequences == []
    assert engine.abort(rid).num_output_tokens == 0
    assert not engine.has_unfinished()
    engine.block_manager.check_no_leaks()
