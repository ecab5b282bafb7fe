"""`kv_cache.dtype` fp8 / int8: the stored bytes follow the wire codecs' scheme, attention over the quantized
cache equals attention over its dequantized copy (eager and compiled), and an engine serves from it."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.engine import ATTENTION_ENV
from engine.args import EngineArgs
from engine.kv_cache.kv_format import FP8_BIT_SCALE, FP8_MAX, KVFormat, fp8_bits_to_float
from engine.model.attention import build_metadata, decode_attention, gather_kv, paged_attention
from engine.model.attention_compiled import CompiledDecode
from engine.sampling.params import SamplingParams
from kv_transfer.codec import get_codec

LAYERS, HEADS, BLOCK, DIM = 2, 2, 16, 32
KINDS = ("fp8", "int8")


def fmt(kind: str, dtype=torch.float32) -> KVFormat:
    return KVFormat(kind, LAYERS, HEADS, BLOCK, DIM, dtype)


def rows(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, 2, HEADS, DIM, generator=torch.Generator().manual_seed(seed)) * scale


def write(f: KVFormat, cache: torch.Tensor, x: torch.Tensor, block: int, start: int) -> None:
    """Rows x [n, 2, H, D] into `block` from offset `start` (one write call)."""
    n = x.shape[0]
    f.write(cache, x[:, 0], x[:, 1], torch.full((n,), block), torch.arange(start, start + n))


@pytest.mark.parametrize("kind", KINDS)
def test_a_decode_step_writes_the_same_bytes_by_the_distinct_block_path(kind):
    """One row per block (a pure decode step: `distinct`) skips fp8's per-block reduction; the bytes are the
    general path's, for rows that start a block, continue it, and grow its scale."""
    f = fmt(kind)
    general = f.allocate(6, torch.device("cpu"))[0]
    for b in range(1, 5):                                          # earlier rows of blocks 1..4
        write(f, general, rows(5, seed=b), b, 0)
    fast = general.clone()
    x = rows(5, seed=9, scale=3.0)                                 # larger: most scales grow
    blocks, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([5, 5, 5, 5, 0])
    f.write(general, x[:, 0], x[:, 1], blocks, offsets)
    f.write(fast, x[:, 0], x[:, 1], blocks, offsets, distinct=True)
    assert torch.equal(general, fast)


def test_fp8_bits_read_as_torch_converts_them():
    """Every finite float8_e4m3fn byte, signed zeros and subnormals included, reads back as torch's own
    conversion (the bit moves the eager gather and the compiled decode kernel share)."""
    bits = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    expected = bits.view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(expected)                              # 0x7F / 0xFF are NaN in e4m3fn
    got = fp8_bits_to_float(bits) * FP8_BIT_SCALE
    assert int(finite.sum()) == 254
    assert torch.equal(got[finite], expected[finite])
    assert torch.equal(got[finite].signbit(), expected[finite].signbit())


@pytest.mark.parametrize("kind", KINDS)
def test_a_block_written_at_once_is_the_wire_codecs_encoding(kind):
    f, x = fmt(kind), rows(BLOCK, seed=1)
    cache = f.allocate(4, torch.device("cpu"))[0]
    write(f, cache, x, 2, 0)
    data, scales = f.split(cache)
    block = x.permute(1, 2, 0, 3)[None, None]                      # [l=1, n=1, 2, H, bs, D]
    codec = get_codec(kind)
    payload = torch.empty(codec.payload_nbytes(tuple(block.shape), block.dtype), dtype=torch.uint8)
    codec.encode(block.contiguous(), payload)
    wire_scales, wire_data = codec._split(payload, tuple(block.shape), block.dtype)
    assert torch.equal(data[2].view(torch.uint8), wire_data[0, 0].view(torch.uint8))
    assert torch.equal(scales[2].reshape(-1), wire_scales.reshape(-1))


@pytest.mark.parametrize("kind", KINDS)
def test_appends_follow_the_scheme_and_rows_read_back_close(kind):
    f = fmt(kind)
    cache = f.allocate(3, torch.device("cpu"))[0]
    small, large = rows(5, seed=2, scale=0.5), rows(4, seed=3, scale=4.0)
    write(f, cache, rows(BLOCK, seed=9, scale=9.0), 1, 0)       # stale rows an earlier request left
    write(f, cache, small, 1, 0)                                  # a new block: its scale is its own rows'
    data, scales = f.split(cache)
    before = data[1].view(torch.uint8).clone()
    write(f, cache, small[:2] * 0.5, 1, 5)                        # rows under the block's amax
    if kind == "fp8":
        assert torch.equal(scales[1, :, :, 0], small.abs().amax((0, 3)) / FP8_MAX)
        assert torch.equal(data[1, :, :, :5].view(torch.uint8), before[:, :, :5])   # earlier bytes unchanged
    write(f, cache, large, 1, 7)                                  # rows that raise it
    got = f.dequantize(data[1], scales[1]).permute(2, 0, 1, 3)[:11]    # [11, 2, H, D]
    want = torch.cat((small, small[:2] * 0.5, large))
    if kind == "fp8":
        assert torch.equal(scales[1, :, :, 0], want.abs().amax((0, 3)) / FP8_MAX)
        tol = 2 * 2 ** -3 * want.abs().amax((0, 3))[None, :, :, None]      # two e4m3 roundings at most
    else:
        tol = want.abs().amax(-1, keepdim=True) / 127                        # one int8 step per row
    assert ((got - want).abs() <= tol + 1e-7).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compiled", [False, True])
def test_attention_reads_the_dequantized_cache(kind, compiled):
    """Prefill continuation and decode rows over the quantized cache equal the same attention over a
    model-dtype cache holding its dequantized values."""
    f = fmt(kind)
    gen = torch.Generator().manual_seed(4)
    cache = f.allocate(12, torch.device("cpu"))[0]
    tables = [[3, 7, 1], [5, 2, 9, 11]]
    lens = [40, 50]
    for table, n in zip(tables, lens):                            # the context, written in two chunks
        x = torch.randn(n, 2, HEADS, DIM, generator=gen)
        pos = torch.arange(n)
        blocks = torch.tensor(table)[pos // BLOCK]
        for part in (slice(0, 20), slice(20, n)):
            f.write(cache, x[part, 0], x[part, 1], blocks[part], pos[part] % BLOCK)
    kernel = CompiledDecode(f) if compiled else None
    q = torch.randn(3, 2 * HEADS, DIM, generator=gen)
    k, v = (torch.randn(3, HEADS, DIM, generator=gen) for _ in range(2))
    seqs = [(lens[0], 2, tables[0]), (lens[1], 1, tables[1])]      # a 2-token prefill chunk, one decode row
    got = paged_attention(q, k, v, cache, build_metadata(seqs, BLOCK, q.device, kernel, kv_format=f), DIM ** -0.5)
    # the reference reads what the quantized cache holds after this step's writes, new rows included
    after = f.blocks(cache[None], torch.arange(12))[0]              # [NB, 2, H, bs, D] float32
    reference = after.clone()
    new_rows = torch.stack([after[b, :, :, o] for b, o in ((tables[0][2], 8), (tables[0][2], 9), (tables[1][3], 2))])
    want = paged_attention(q, new_rows[:, 0], new_rows[:, 1], reference,
                           build_metadata(seqs, BLOCK, q.device), DIM ** -0.5)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    # decode alone, through the kernel the engine uses
    table = torch.tensor([tables[1][:3] + [0]])
    bias = torch.zeros(1, 4 * BLOCK)
    bias[:, lens[1] - 16:] = float("-inf")
    qd = q[2:]
    expect = decode_attention(qd, gather_kv(after, table), bias, DIM ** -0.5)
    if compiled:
        assert torch.allclose(kernel(qd, cache, table, bias, DIM ** -0.5), expect, atol=1e-5, rtol=1e-4)
    assert torch.allclose(decode_attention(qd, gather_kv(cache, table, f), bias, DIM ** -0.5), expect, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_an_engine_serves_from_a_quantized_cache(kind, tiny_model_dir):
    auto = Engine(EngineArgs(model=tiny_model_dir, kv_cache_gib=0.01, attention="eager"))
    quantized = Engine(EngineArgs(model=tiny_model_dir, kv_cache_gib=0.01, kv_cache_dtype=kind, attention="eager"))
    compiled = Engine(EngineArgs(model=tiny_model_dir, kv_cache_gib=0.01, kv_cache_dtype=kind))
    # the budget counts the smaller blocks: float32 values become one byte, plus the scales
    ratio = quantized.block_manager.num_blocks / auto.block_manager.num_blocks
    assert ratio == pytest.approx(auto.kv_bytes_per_block / quantized.kv_bytes_per_block, rel=0.02) and ratio > 3.5
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 16, 37)]
    want = [c.token_ids for c in auto.generate(prompts, params)]
    got = [c.token_ids for c in quantized.generate(prompts, params)]
    assert [c.token_ids for c in compiled.generate(prompts, params)] == got        # eager = compiled kernel
    agree = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) / sum(map(len, want))
    assert agree >= 0.5                                            # a random model: near ties fork
    assert quantized.block_manager.num_used_blocks == 0 or quantized.block_manager.cached     # blocks returned


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_do_not_depend_on_cached_prefixes_or_chunks(kind, tiny_model_dir):
    """Every query reads K/V as stored, its own prompt rows included: a prompt computed whole, after a prefix
    hit, or (int8: rows quantized one at a time) in chunks gives the same logprobs, so migration and
    decode-side prefix reuse replay a stream exactly."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    base, tail = list(range(7, 7 + 48)), list(range(300, 309))

    def run(engine, prompt):
        [c] = engine.generate([prompt], params)
        return c.token_ids, torch.tensor([lp.logprob for lp in c.logprobs]), c.num_cached_tokens

    def same(a, b):     # the same rows in another summation order: the same tokens, logprobs to rounding
        return a[0] == b[0] and torch.allclose(a[1], b[1], atol=1e-5, rtol=0)
    whole = Engine(EngineArgs(model=tiny_model_dir, num_blocks=64, kv_cache_dtype=kind, attention="eager"))
    cold = run(whole, base + tail)
    run(whole, base)
    hit = run(whole, base + tail)
    assert hit[2] >= 48 and same(hit, cold)
    if kind == "int8":
        chunked = Engine(EngineArgs(model=tiny_model_dir, num_blocks=64, kv_cache_dtype=kind, attention="eager",
                                    chunk_size=8, max_num_batched_tokens=64))
        assert same(run(chunked, base + tail), cold)


def test_flex_is_refused_for_a_quantized_cache_and_auto_decodes_it_compiled(tiny_model_dir, monkeypatch):
    """Where `auto` means flex (CUDA; here $PDSERVE_ATTENTION), a quantized cache decodes through the compiled
    kernel, which dequantizes in its loops, with the eager engine's tokens; an explicit flex is refused."""
    with pytest.raises(ValueError, match="does not read"):
        Engine(EngineArgs(model=tiny_model_dir, kv_cache_dtype="fp8", attention="flex-eager"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 21)]
    eager = Engine(EngineArgs(model=tiny_model_dir, num_blocks=64, kv_cache_dtype="int8", attention="eager"))
    monkeypatch.setenv(ATTENTION_ENV, "flex")
    auto = Engine(EngineArgs(model=tiny_model_dir, num_blocks=64, kv_cache_dtype="int8"))
    assert auto.attention == "compiled"
    want = [c.token_ids for c in eager.generate(prompts, params)]
    assert [c.token_ids for c in auto.generate(prompts, params)] == want
