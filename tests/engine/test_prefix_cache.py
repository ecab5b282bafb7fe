"""Block pool and prefix cache: exact block ids, LRU eviction, hit tokens, no leaks."""
from __future__ import annotations

from engine import Engine, EngineArgs, SamplingParams
import random

from engine.kv_cache.block_manager import BlockManager, hash_block, prompt_block_hashes


def test_allocate_free_exact_ids_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = bm.allocate(3)
    assert a == [0, 1, 2]
    hashes = prompt_block_hashes(list(range(12)), 4)
    for block_id, h in zip(a, hashes):
        bm.register(block_id, h)
    bm.free(a)                               # freed tail first: LRU order 2, 1, 0
    assert bm.allocate(4) == [3, 4, 5, 2]    # the never-used blocks, then evicts 2 (the tail block)
    assert bm.match_prefix(hashes) == [0, 1]
    assert bm.allocate(10) is None           # allocation failure returns None, changes nothing
    assert bm.num_free_blocks == 2


def test_chained_hashes_distinguish_same_block_after_different_prefix():
    h1 = prompt_block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    h2 = prompt_block_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert h1[1] != h2[1]


def test_prompt_hashes_are_the_chain_the_scheduler_registers_block_by_block():
    # the router and an admitted prompt use prompt_block_hashes; computed blocks are registered with hash_block
    rng = random.Random(0)
    for length, block_size in ((0, 4), (3, 4), (4, 4), (37, 4), (1000, 16), (129, 64), (5, 1)):
        ids = [rng.randrange(2**32) for _ in range(length)]
        chain, parent = [], None
        for b in range(length // block_size):
            parent = hash_block(parent, ids[b * block_size:(b + 1) * block_size])
            chain.append(parent)
        assert prompt_block_hashes(ids, block_size) == chain


def test_shared_prefix_hits_and_identical_output(tiny_model_dir):
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=128, block_size=16))
    system = list(range(2, 2 + 100))                 # 6 full blocks + 4 tokens
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = engine.generate([system + [500, 501]], params)[0]
    assert first.num_cached_tokens == 0
    second = engine.generate([system + [500, 501]], params)[0]
    assert second.num_cached_tokens == 96
    assert second.token_ids == first.token_ids
    third = engine.generate([system + [700]], params)[0]
    assert third.num_cached_tokens == 96
    cold = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=128, enable_prefix_cache=False))
    assert cold.generate([system + [700]], params)[0].token_ids == third.token_ids
    engine.block_manager.check_no_leaks()


def test_fully_cached_prompt_still_computes_last_token(tiny_model_dir):
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64, block_size=16))
    prompt = list(range(2, 2 + 64))                  # exactly 4 blocks
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    a = engine.generate([prompt], params)[0]
    b = engine.generate([prompt], params)[0]
    assert b.num_cached_tokens == 48 and a.token_ids == b.token_ids
    engine.block_manager.check_no_leaks()


def test_eviction_under_pressure_keeps_outputs_exact(tiny_model_dir):
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=24, block_size=16))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[t] * 150 for t in range(3, 9)]       # each needs 10 blocks: cache must evict
    outs = [engine.generate([p], params)[0] for p in prompts]
    again = engine.generate([prompts[0]], params)[0]
    assert again.num_cached_tokens == 0              # evicted long ago (LRU)
    assert again.token_ids == outs[0].token_ids
    engine.block_manager.check_no_leaks()
