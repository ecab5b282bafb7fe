"""The compiled decode-attention kernel equals the eager gather + bmm path, and the engine picks it safely."""
from __future__ import annotations

import logging

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.model import attention_compiled
from engine.model.attention import decode_attention, gather_kv
from engine.model.attention_compiled import CompiledDecode


@pytest.fixture(scope="module")
def kernel() -> CompiledDecode:
    k = CompiledDecode()
    k.warm_up(torch.zeros(4, 2, 2, 16, 32), num_heads=6)
    return k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs,width", [(1, 2), (2, 3), (7, 5), (16, 9)])
def test_kernel_equals_eager(kernel, dtype, num_seqs, width):
    g = torch.Generator().manual_seed(num_seqs * 31 + width)
    num_blocks, kv_heads, block_size, dim, heads = 40, 2, 16, 32, 6
    cache = torch.randn(num_blocks, 2, kv_heads, block_size, dim, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(num_seqs)])  # scattered ids
    lengths = torch.randint(1, width * block_size + 1, (num_seqs,), generator=g)
    bias = torch.zeros(num_seqs, width * block_size).masked_fill_(
        torch.arange(width * block_size)[None, :] >= lengths[:, None], float("-inf"))
    with torch.inference_mode():
        q = torch.randn(num_seqs, heads, dim, generator=g).to(dtype)
        got = kernel(q, cache, tables, bias, dim ** -0.5)
    want = decode_attention(q, gather_kv(cache, tables), bias, dim ** -0.5)
    assert got.shape == want.shape == (num_seqs, heads, dim) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_engine_compiled_equals_eager_tokens(tiny_model_dir):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 1000, (n,), generator=g).tolist() for n in (3, 17, 40, 90, 150, 1)]
    params = [SamplingParams(max_tokens=24 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    outs = {}
    for mode in ("compiled", "eager"):
        engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=256, attention=mode))
        assert engine.attention == mode
        outs[mode] = [c.token_ids for c in engine.generate(prompts, params)]
        assert engine.block_manager.num_used_blocks == 0          # every block back in the pool
    assert outs["compiled"] == outs["eager"]


def test_attention_choice(tiny_model_dir, monkeypatch, caplog):
    with pytest.raises(ValueError, match="attention must be one of"):
        Engine(EngineArgs(tiny_model_dir, num_blocks=16, attention="fast"))
    monkeypatch.setenv("PDSERVE_ATTENTION", "eager")
    assert Engine(EngineArgs(tiny_model_dir, num_blocks=16)).attention == "eager"
    monkeypatch.delenv("PDSERVE_ATTENTION")

    def broken(self, *args):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(attention_compiled.CompiledDecode, "warm_up", broken)
    with caplog.at_level(logging.WARNING):
        assert Engine(EngineArgs(tiny_model_dir, num_blocks=16)).attention == "eager"      # auto falls back, says why
    assert "no compiler" in caplog.text
    with pytest.raises(RuntimeError, match="attention='compiled'"):
        Engine(EngineArgs(tiny_model_dir, num_blocks=16, attention="compiled"))
