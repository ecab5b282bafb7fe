"""The flex paged kernel compiled by Inductor (Triton) and the decode CUDA graphs, on a CUDA device:
equal to the eager path (kernel rows, engine tokens and logprobs). Skipped without CUDA; the CPU tests
(tests/engine/test_attention_flex.py, test_decode_graphs.py) run the same code through flex's reference
math and without capture."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.model.attention import build_metadata, paged_attention
from engine.model.attention_flex import FlexAttention
from window_support import random_prompts, write_window_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
NUM_BLOCKS, KV_HEADS, BLOCK, DIM, HEADS = 64, 2, 16, 64, 8


def _step(seed: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    shared = ids.pop()
    table = lambda n: [ids.pop() for _ in range(n)]          # noqa: E731
    seqs = [(0, 70, table(5)), (32, 40, [shared] + table(4)), (20, 1, [shared, ids.pop()]), (200, 1, table(13)),
            (0, 3, table(1)), (47, 1, table(3)), (16, 150, [shared] + table(10))]
    num_tokens = sum(n for _, n, _ in seqs)
    cache = torch.randn(NUM_BLOCKS, 2, KV_HEADS, BLOCK, DIM, generator=g)
    q = torch.randn(num_tokens, HEADS, DIM, generator=g)
    k, v = (torch.randn(num_tokens, KV_HEADS, DIM, generator=g) for _ in range(2))
    return seqs, *(x.to(device=device, dtype=dtype) for x in (cache, q, k, v))


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_equals_eager_path(window, dtype):
    device = torch.device("cuda")
    kernel = FlexAttention(NUM_BLOCKS, KV_HEADS, BLOCK, device, compile=True, max_model_len=1024)
    for seed in (1, 2):           # a second step of other lengths: the compiled kernels serve it (no fallback)
        seqs, cache, q, k, v = _step(seed, "cuda", dtype)
        with torch.inference_mode():
            got = paged_attention(q, k, v, cache.clone(), build_metadata(seqs, BLOCK, device, sliding_window=window,
                                                                         flex_kernel=kernel), DIM ** -0.5)
            want = paged_attention(q, k, v, cache.clone(), build_metadata(seqs, BLOCK, device,
                                                                          sliding_window=window), DIM ** -0.5)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("flex-gpu")
    return {"window": write_window_model(str(root / "window"), sliding_window=40),
            "full": write_window_model(str(root / "full"), sliding_window=None)}


def _generate(model_dir: str, **kw):
    engine = Engine(EngineArgs(model_dir, dtype="float32", device="cuda", num_blocks=256, block_size=BLOCK,
                               chunk_size=48,
                               max_num_batched_tokens=128, max_num_seqs=16, **kw))
    base = random_prompts([64], seed=7)[0]
    prompts = random_prompts([90, 5, 60, 33, 130, 17], seed=8) + [base + t for t in random_prompts([3, 20], seed=9)]
    params = [SamplingParams(max_tokens=16 + 4 * i, temperature=0.0, ignore_eos=True, logprobs=0)
              for i in range(len(prompts))]
    outs = engine.generate(prompts[:6], params[:6]) + engine.generate(prompts[6:], params[6:])
    assert outs[-1].num_cached_tokens == 64
    engine.block_manager.check_no_leaks()
    return engine, [c.token_ids for c in outs], [[lp.logprob for lp in c.logprobs] for c in outs]


@pytest.mark.parametrize("name", ["window", "full"])
def test_engine_flex_and_graphs_equal_eager(model_dirs, name):
    _, eager_tokens, eager_lps = _generate(model_dirs[name], attention="eager")
    for graphs in (False, True):
        engine, tokens, lps = _generate(model_dirs[name], attention="flex", cuda_graphs=graphs)
        assert engine.attention == "flex"
        if graphs:
            assert all(b.graph is not None for b in engine.runner.graphs.buckets.values())
        assert tokens == eager_tokens
        for a, b in zip(lps, eager_lps):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)
