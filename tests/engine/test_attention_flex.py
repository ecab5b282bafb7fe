"""The flex paged kernel (engine/model/attention_flex.py) equals the eager SDPA/bmm path: the same strided views,
block masks and mask_mod that run compiled on CUDA, here through flex's reference math on CPU."""
from __future__ import annotations

import logging

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.model import attention_flex
from engine.model.attention import build_metadata, paged_attention
from engine.model.attention_flex import FlexAttention, build_flex_metadata, paged_views
from window_support import WINDOW, one_thread, random_prompts, write_window_model

NUM_BLOCKS, KV_HEADS, BLOCK, DIM, HEADS = 24, 2, 4, 16, 6


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


def test_paged_views_read_the_cache_in_place():
    cache = torch.randn(NUM_BLOCKS, 2, KV_HEADS, BLOCK, DIM)
    key, value = paged_views(cache)
    rows = (NUM_BLOCKS - 1) * 2 * KV_HEADS * BLOCK + BLOCK
    assert key.shape == value.shape == (1, KV_HEADS, rows, DIM)
    assert key.data_ptr() == cache.data_ptr() and value.untyped_storage().data_ptr() == cache.data_ptr()
    for block, head, offset in ((0, 0, 0), (5, 1, 3), (NUM_BLOCKS - 1, 1, BLOCK - 1)):
        row = block * 2 * KV_HEADS * BLOCK + offset
        assert torch.equal(key[0, head, row], cache[block, 0, head, offset])
        assert torch.equal(value[0, head, row], cache[block, 1, head, offset])


def _kv_blocks(num, idx, tile):
    return idx[0, 0, tile, :num[0, 0, tile]].tolist()


def test_block_mask_lists_each_tiles_pages_once():
    # seq 0: fresh, 6 tokens (pages 3, 7); seq 1: 5 tokens after a 4-token prefix (pages 9, 2, 5);
    # seq 2: decode at position 9 (pages 1, 4, 8); q_tile 4 -> packed prefill rows 0-3 | 4-7 | 8-10
    seqs = [(0, 6, [3, 7]), (4, 5, [9, 2, 5]), (9, 1, [1, 4, 8])]
    meta = build_flex_metadata(seqs, BLOCK, NUM_BLOCKS, KV_HEADS, torch.device("cpu"), q_tile=4)
    unit = 2 * KV_HEADS
    mask = meta.prefill.block_mask
    assert mask.kv_num_blocks.shape == (1, 1, 3)
    assert meta.prefill.rows.tolist() == list(range(11)) and meta.decode.rows.tolist() == [11]
    # tile 0: seq 0 rows at positions 0-3: page 3, partial (causal inside it)
    assert _kv_blocks(mask.kv_num_blocks, mask.kv_indices, 0) == [3 * unit]
    assert _kv_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, 0) == []
    # tile 1: seq 0 positions 4-5 (pages 3, 7) and seq 1 positions 4-5 (pages 9, 2): two sequences, all partial
    assert _kv_blocks(mask.kv_num_blocks, mask.kv_indices, 1) == [3 * unit, 7 * unit, 9 * unit, 2 * unit]
    # tile 2: seq 1 positions 6-8: page 9 whole for every query, pages 2 and 5 partial
    assert _kv_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, 2) == [9 * unit]
    assert _kv_blocks(mask.kv_num_blocks, mask.kv_indices, 2) == [2 * unit, 5 * unit]
    dec = meta.decode.block_mask
    assert _kv_blocks(dec.full_kv_num_blocks, dec.full_kv_indices, 0) == [1 * unit, 4 * unit]
    assert _kv_blocks(dec.kv_num_blocks, dec.kv_indices, 0) == [8 * unit]
    # with a window of 5 the decode at 9 reads positions 5-9: page 1 dropped, page 4 partial
    meta = build_flex_metadata(seqs, BLOCK, NUM_BLOCKS, KV_HEADS, torch.device("cpu"), sliding_window=5)
    dec = meta.decode.block_mask
    assert _kv_blocks(dec.full_kv_num_blocks, dec.full_kv_indices, 0) == []
    assert _kv_blocks(dec.kv_num_blocks, dec.kv_indices, 0) == [4 * unit, 8 * unit]


def _random_step(seed: int):
    """A mixed step: fresh prompts, chunks after cached prefixes (one sharing a prefix page with another
    sequence of the same tile), decodes; scattered block ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    shared = ids.pop()
    table = lambda n: [ids.pop() for _ in range(n)]          # noqa: E731
    seqs = [(0, 7, table(2)), (8, 6, [shared] + table(3)), (4, 1, [shared] + table(1)), (13, 1, table(4)),
            (0, 2, table(1)), (10, 1, table(3)), (4, 9, [shared] + table(3))]
    num_tokens = sum(n for _, n, _ in seqs)
    cache = torch.randn(NUM_BLOCKS, 2, KV_HEADS, BLOCK, DIM, generator=g)
    q = torch.randn(num_tokens, HEADS, DIM, generator=g)
    k, v = (torch.randn(num_tokens, KV_HEADS, DIM, generator=g) for _ in range(2))
    return seqs, cache, q, k, v


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
@pytest.mark.parametrize("q_tile", [4, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_eager_path_on_a_mixed_step(window, q_tile, dtype):
    seqs, cache, q, k, v = _random_step(seed=q_tile + (window or 0))
    cache, q, k, v = (x.to(dtype) for x in (cache, q, k, v))
    kernel = FlexAttention(NUM_BLOCKS, KV_HEADS, BLOCK, torch.device("cpu"), compile=False, q_tile=q_tile)
    kernel.pad_decode = q_tile == 4          # padded decode batches (as compiled) give the same rows
    with torch.inference_mode():
        flex_cache, eager_cache = cache.clone(), cache.clone()
        got = paged_attention(q, k, v, flex_cache, build_metadata(seqs, BLOCK, torch.device("cpu"),
                              sliding_window=window, flex_kernel=kernel), DIM ** -0.5)
        want = paged_attention(q, k, v, eager_cache, build_metadata(seqs, BLOCK, torch.device("cpu"),
                               sliding_window=window), DIM ** -0.5)
    assert torch.equal(flex_cache, eager_cache)               # the same slots written
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_only_decodes_and_only_prefills():
    seqs, cache, q, k, v = _random_step(seed=3)
    kernel = FlexAttention(NUM_BLOCKS, KV_HEADS, BLOCK, torch.device("cpu"), compile=False)
    for part in ([s for s in seqs if s[1] == 1], [s for s in seqs if s[1] > 1]):
        n = sum(x[1] for x in part)
        with torch.inference_mode():
            got = paged_attention(q[:n], k[:n], v[:n], cache.clone(),
                                  build_metadata(part, BLOCK, torch.device("cpu"), flex_kernel=kernel), DIM ** -0.5)
            want = paged_attention(q[:n], k[:n], v[:n], cache.clone(),
                                   build_metadata(part, BLOCK, torch.device("cpu")), DIM ** -0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("flex-models")
    return {"window": write_window_model(str(root / "window")),
            "full": write_window_model(str(root / "full"), sliding_window=None)}


@pytest.mark.parametrize("name", ["window", "full"])
def test_engine_flex_equals_eager(model_dirs, name, monkeypatch):
    """GQA model with and without a sliding window: chunked prefill (chunks below and above the window),
    prefix-cache hits, mixed prefill + decode steps, several query tiles a step: greedy tokens identical,
    logprobs and prompt logits within float32 tolerance."""
    monkeypatch.setattr(attention_flex, "Q_TILE", 16)
    base = random_prompts([24], seed=7)[0]
    prompts = random_prompts([41, 5, 30], seed=8) + [base + t for t in random_prompts([3, 9], seed=9)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    results = {}
    for mode in ("flex-eager", "eager"):
        engine = Engine(EngineArgs(model_dirs[name], dtype="float32", num_blocks=48, block_size=BLOCK, attention=mode,
                                   chunk_size=12, max_num_batched_tokens=40))
        assert engine.attention == mode
        assert engine.config.sliding_window == (WINDOW if name == "window" else None)
        first = engine.generate(prompts[:4], params)
        second = engine.generate(prompts[4:], params)          # the shared 24 tokens from the prefix cache
        assert second[0].num_cached_tokens == 24
        blocks = engine.block_manager.allocate(-(-len(prompts[0]) // BLOCK))
        logits = engine.runner.score(prompts[0], blocks)
        engine.block_manager.free(blocks)
        engine.block_manager.check_no_leaks()
        results[mode] = ([c.token_ids for c in first + second],
                         torch.tensor([[lp.logprob for lp in c.logprobs] for c in first + second]), logits)
    assert results["flex-eager"][0] == results["eager"][0]
    torch.testing.assert_close(results["flex-eager"][1], results["eager"][1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(results["flex-eager"][2], results["eager"][2], atol=1e-4, rtol=1e-4)


def test_flex_falls_back_when_the_check_fails(model_dirs, monkeypatch, caplog):
    def disagree(self, *args):
        raise RuntimeError("flex paged attention disagrees with the eager path")
    monkeypatch.setattr(FlexAttention, "warm_up", disagree)
    monkeypatch.setenv("PDSERVE_ATTENTION", "flex-eager")       # what auto picks on CUDA, here through the env
    with caplog.at_level(logging.WARNING):
        assert Engine(EngineArgs(model_dirs["full"], num_blocks=16, block_size=BLOCK,
                                 attention="auto")).attention == "eager"
    monkeypatch.delenv("PDSERVE_ATTENTION")
    assert "disagrees with the eager path" in caplog.text               # auto falls back and says why
    with pytest.raises(RuntimeError, match="attention='flex-eager'"):
        Engine(EngineArgs(model_dirs["full"], num_blocks=16, block_size=BLOCK, attention="flex-eager"))


def test_compiled_flex_is_cuda_only(model_dirs):
    with pytest.raises(ValueError, match="CUDA only"):
        FlexAttention(NUM_BLOCKS, KV_HEADS, BLOCK, torch.device("cpu"), compile=True)
    with pytest.raises(RuntimeError, match="attention='flex'"):
        Engine(EngineArgs(model_dirs["full"], num_blocks=16, block_size=BLOCK, attention="flex"))
