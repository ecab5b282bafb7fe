"""Continuous batching, chunked prefill and preemption produce exactly the solo outputs."""
from __future__ import annotations

import torch

from engine import Engine, EngineArgs, SamplingParams


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 200, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for length in lengths]


def _solo(model_dir: str, prompts, params_list) -> list[list[int]]:
    engine = Engine(EngineArgs(model_dir, dtype="float32", num_blocks=512, chunk_size=None, enable_prefix_cache=False))
    return [engine.generate([p], prm)[0].token_ids for p, prm in zip(prompts, params_list)]


def _staggered(engine: Engine, prompts, params_list, every: int = 2) -> dict[int, list[int]]:
    """Add one request every `every` steps while the batch runs."""
    pending = list(enumerate(zip(prompts, params_list)))
    ids: dict[str, int] = {}
    results: dict[int, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, (p, prm) = pending.pop(0)
            ids[engine.add_request(p, prm)] = i
        for out in engine.step():
            results.setdefault(ids[out.request_id], []).extend(out.new_token_ids)
        step += 1
    return results


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=8 + (i * 7) % 40, temperature=0.0 if i % 2 else 0.8, seed=i,
                           ignore_eos=True) for i in range(n)]


def test_continuous_batching_equals_solo(tiny_model_dir):
    prompts, params = _prompts(16, 1024), _params(16)
    solo = _solo(tiny_model_dir, prompts, params)
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=512, chunk_size=None))
    got = _staggered(engine, prompts, params)
    assert [got[i] for i in range(16)] == solo
    engine.block_manager.check_no_leaks()


def test_chunked_prefill_equals_solo(tiny_model_dir):
    prompts, params = _prompts(16, 1024, seed=1), _params(16)
    solo = _solo(tiny_model_dir, prompts, params)
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=512, chunk_size=16,
                               max_num_batched_tokens=64))
    got = _staggered(engine, prompts, params, every=1)
    assert [got[i] for i in range(16)] == solo
    engine.block_manager.check_no_leaks()


def test_preemption_by_recompute_equals_solo(tiny_model_dir):
    prompts, params = _prompts(16, 1024, seed=2), _params(16)
    solo = _solo(tiny_model_dir, prompts, params)
    # 40 blocks x 16 tokens cannot hold 16 requests at once: the scheduler must preempt.
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=40, chunk_size=32,
                               max_num_batched_tokens=128))
    got = _staggered(engine, prompts, params, every=1)
    assert engine.scheduler.num_preemptions > 0
    assert [got[i] for i in range(16)] == solo
    engine.block_manager.check_no_leaks()


def test_prefill_only_then_adopt_equals_colocated(tiny_model_dir):
    """The worker split: prefill on one engine, copy the blocks, decode on another."""
    prompts, params = _prompts(6, 1024, seed=3), _params(6)
    expected = _solo(tiny_model_dir, prompts, params)
    prefill = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=128))
    decode = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=128))
    handoffs = {}
    for i, (p, prm) in enumerate(zip(prompts, params)):
        prefill.add_request(p, prm, request_id=f"r{i}", prefill_only=True)
    while prefill.has_unfinished():
        for out in prefill.step():
            assert out.prefilled
            handoffs[out.request_id] = out
    for rid, out in handoffs.items():
        i = int(rid[1:])
        dst = decode.block_manager.allocate(len(out.block_ids))
        decode.kv_cache[:, dst] = prefill.kv_cache[:, out.block_ids]
        prefill.release(rid)
        decode.expect_kv(rid, prompts[i], params[i], transfer_id=rid, deadline=float("inf"))
        decode.adopt(rid, [out.new_token_ids[0]], dst)
    got = {rid: list(handoffs[rid].new_token_ids) for rid in handoffs}
    while decode.has_unfinished():
        for out in decode.step():
            got[out.request_id].extend(out.new_token_ids)
    assert [got[f"r{i}"] for i in range(6)] == expected
    prefill.block_manager.check_no_leaks()
    decode.block_manager.check_no_leaks()


def test_abort_frees_blocks(tiny_model_dir):
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64))
    rid = engine.add_request(list(range(2, 100)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort(rid).finish_reason == "abort"
    assert not engine.has_unfinished()
    engine.block_manager.check_no_leaks()


def test_resume_after_migration_continues_identically(tiny_model_dir):
    """A request moved mid-stream (prompt + tokens so far recomputed) continues exactly, seeded too."""
    prompts, params = _prompts(4, 1024, seed=4), _params(4)
    params = [SamplingParams(max_tokens=30, temperature=t, seed=9, ignore_eos=True) for t in (0.0, 0.9, 0.0, 1.2)]
    full = _solo(tiny_model_dir, prompts, params)
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=256))
    for p, prm, expected in zip(prompts, params, full):
        rid = engine.add_request(p, prm, resume_output_ids=expected[:11])
        got = []
        while engine.has_unfinished():
            got += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        assert expected[:11] + got == expected
    engine.block_manager.check_no_leaks()
