"""KV transfer between tensor-parallel degrees: every receiving rank ends up with exactly its heads of the
sent blocks (the reshard plan's reference, `apply_plan`), over every transport and both codecs, streamed
layer by layer or in one piece; a quantized cache (fp8 / int8 cells with their scales) the same, byte for
byte, scales included; one block list shared by the receiving ranks; nothing left reserved when a copy fails,
expires or is cancelled."""
from __future__ import annotations

import pytest
import torch
from kv_helpers import TOKEN, assert_no_leak, wait_for

from engine.kv_cache.kv_format import KVFormat
from engine.model.config import ModelConfig
from engine.parallel.reshard import reshard_plan
from engine.parallel.shard import kv_head_ranges
from kv_transfer import FakeHub, KVLayout, KVPiece, SimpleBlockPool, TransferStatus, get_codec
from kv_transfer import make_receiver, make_sender
from kv_transfer.codec import stored_codec
from kv_transfer.resharded import ReshardedReceiver, ReshardedSender, head_layout, head_view, parse_group_endpoint
from kv_transfer.transports.nixl import agent as nixl_agent
from kv_transfer.transports.tcp.rows import CellRuns

CFG = ModelConfig("llama", 64, 128, 256, 3, 4, 2, 8, 128)       # 4 attention heads, 2 KV heads, 3 layers
NUM_SRC_BLOCKS, NUM_DST_BLOCKS = 6, 16
NIXL = pytest.param("nixl", marks=pytest.mark.skipif(nixl_agent.available() is not None,
                                                     reason=f"nixl cannot be imported: {nixl_agent.available()}"))


def _layouts(degree: int, cache_dtype: str = "auto") -> list[KVLayout]:
    return [KVLayout(num_layers=3, num_kv_heads=len(r), block_size=4, head_dim=8, dtype=torch.float32,
                     model_fingerprint="tiny-tp", cache_dtype=cache_dtype, tensor_parallel=degree,
                     kv_head_start=r.start)
            for r in kv_head_ranges(CFG, degree)]


def _format(cache_dtype: str, num_heads: int) -> KVFormat:
    return KVFormat(cache_dtype, 3, num_heads, 4, 8, torch.float32)


def _quantized_cache(cache_dtype: str, generator: torch.Generator) -> torch.Tensor:
    """The model's whole quantized cache (both KV heads), every slot written by the engine's own format."""
    fmt, slots = _format(cache_dtype, 2), torch.arange(NUM_SRC_BLOCKS * 4)
    cache = fmt.allocate(NUM_SRC_BLOCKS, torch.device("cpu"))
    for layer in range(3):
        k, v = (torch.randn(len(slots), 2, 8, generator=generator) * torch.tensor([1.0, 5.0])[:, None]
                for _ in range(2))
        fmt.write(cache[layer], k, v, slots // 4, slots % 4)
    return cache


def _heads_of(cache_dtype: str, cache: torch.Tensor, heads: range) -> torch.Tensor:
    """A cache holding only `heads` of a whole quantized cache: their values and their scales, as stored."""
    whole, part = _format(cache_dtype, 2), _format(cache_dtype, len(heads))
    out = part.allocate(cache.shape[1], torch.device("cpu"))
    for layer in range(3):
        (data, scales), (out_data, out_scales) = whole.split(cache[layer]), part.split(out[layer])
        out_data.copy_(data[:, :, heads.start:heads.stop])
        out_scales.copy_(scales[:, :, heads.start:heads.stop])
    return out


class Groups:
    """A degree-`source` prefill side and a degree-`dest` decode side of one transport, in this process.

    `cache_dtype` fp8 / int8: both sides' caches are quantized (`codec` is then the cache's stored codec);
    `options`: transport keywords of both ends."""

    def __init__(self, kind: str, source: int, dest: int, codec: str = "none", deadline_s: float = 30.0,
                 cache_dtype: str = "auto", **options):
        generator = torch.Generator().manual_seed(10 * source + dest)
        source_ranges, self.dest_ranges = kv_head_ranges(CFG, source), kv_head_ranges(CFG, dest)
        if cache_dtype == "auto":
            self.full = torch.randn(3, NUM_SRC_BLOCKS, 2, 2, 4, 8, generator=generator)
            self.source_caches = [self.full[:, :, :, r.start:r.stop].clone() for r in source_ranges]
            self.dest_caches = [torch.zeros(3, NUM_DST_BLOCKS, 2, len(r), 4, 8) for r in self.dest_ranges]
        else:
            codec = stored_codec(cache_dtype)
            self.full = _quantized_cache(cache_dtype, generator)
            self.source_caches = [_heads_of(cache_dtype, self.full, r) for r in source_ranges]
            self.dest_caches = [_format(cache_dtype, len(r)).allocate(NUM_DST_BLOCKS, torch.device("cpu"))
                                for r in self.dest_ranges]
        self.pool = SimpleBlockPool(NUM_DST_BLOCKS)
        extra = {"hub": FakeHub()} if kind == "fake" else options      # options: both ends' transport keywords
        dest_layouts = _layouts(dest, cache_dtype)
        self.receiver = ReshardedReceiver.open(
            reshard_plan(CFG, source, dest), source, dest_layouts, self.pool,
            lambda c, layout, blocks, done: make_receiver(
                kind, layout, head_view(self.dest_caches[c.dest_rank], c.dest_heads, layout), blocks, done,
                codec=codec, token=TOKEN, **extra), deadline_s=deadline_s)
        self.sender = ReshardedSender(_layouts(source, cache_dtype), self.source_caches,
                                      lambda rank, heads, layout: make_sender(kind, layout, codec=codec, token=TOKEN,
                                                                              **extra))

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def assert_copies_clean(g: Groups) -> None:
    """Nothing left on either end of any copy: no nixl READ in flight or block held back for one, no staging
    slot taken (the other transports have neither)."""
    receivers = [member for *_, member in g.receiver.members]
    assert wait_for(lambda: all(getattr(r, "num_in_flight", 0) == 0 and
                                (getattr(r, "held", None) is None or r.held.num_deferred == 0) for r in receivers), 5)
    for end in receivers + list(g.sender._senders.values()):
        assert getattr(end, "staging", None) is None or end.staging.num_used == 0


@pytest.fixture
def groups():
    made: list[Groups] = []

    def factory(*args, **kwargs) -> Groups:
        made.append(Groups(*args, **kwargs))
        return made[-1]

    yield factory
    for g in made:
        g.close()


DEGREES = [(2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("source,dest", DEGREES)
@pytest.mark.parametrize("kind", ["tcp", "grpc", "torch", NIXL])
@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_each_receiving_rank_gets_exactly_its_heads(groups, kind, source, dest, codec):
    g = groups(kind, source, dest, codec)
    src_blocks = [4, 1, 3]
    # layer-wise: layer 0 first, the rest with the first token
    first = g.sender.send(KVPiece("r1", g.source_caches[0], src_blocks, transfer_id="t1", layers=(0, 1),
                                  num_tokens=11), g.receiver.endpoint)
    last = g.sender.send(KVPiece("r1", g.source_caches[0], src_blocks, transfer_id="t1", layers=(1, 3),
                                 num_tokens=11, first_token_id=7), g.receiver.endpoint)
    assert first.wait(30) == TransferStatus.DONE, first.error
    assert last.wait(30) == TransferStatus.DONE, last.error
    result = g.receiver.wait("t1", 30)
    assert result is not None and result.status == TransferStatus.DONE, result
    assert (result.num_tokens, result.first_token_id) == (11, 7)
    assert len(result.dst_block_ids) == 3 and g.pool.used_ids == set(result.dst_block_ids)
    expected = g.full.clone()
    if codec != "none":                      # per-block, per-head scales: the same for any head split
        get_codec(codec).roundtrip(expected, torch.tensor(src_blocks))
    for cache, heads in zip(g.dest_caches, g.dest_ranges):
        assert torch.equal(cache[:, result.dst_block_ids], expected[:, src_blocks, :, heads.start:heads.stop])
        untouched = [b for b in range(NUM_DST_BLOCKS) if b not in result.dst_block_ids]
        assert not cache[:, untouched].any()
    assert [r.transfer_id for r in g.receiver.poll()] == ["t1"]          # one result for all copies
    g.pool.free(result.dst_block_ids)
    assert_no_leak(g.pool)
    assert_copies_clean(g)


@pytest.mark.parametrize("source,dest", DEGREES)
@pytest.mark.parametrize("kind", ["tcp", "grpc", "torch", NIXL, "fake"])
@pytest.mark.parametrize("cache_dtype", ["fp8", "int8"])
def test_quantized_heads_arrive_with_their_scales_byte_exact(groups, kind, source, dest, cache_dtype):
    """Layer-wise pieces, the last split in two block ranges; each receiving rank's cells, values and scales, are
    the bytes of the sending cache's heads: as a cache of those heads alone stores them."""
    g = groups(kind, source, dest, cache_dtype=cache_dtype)
    src_blocks = [4, 1, 3, 5]                # a prefix the decode side holds is not among them: it is not sent
    pieces = [((0, 1), None, -1), ((1, 3), (0, 2), -1), ((1, 3), (2, 4), 7)]
    handles = [g.sender.send(KVPiece("r1", g.source_caches[0], src_blocks, transfer_id="t1", layers=layers,
                                     blocks=blocks, num_tokens=15, first_token_id=first), g.receiver.endpoint)
               for layers, blocks, first in pieces]
    assert all(h.wait(30) == TransferStatus.DONE for h in handles), [h.error for h in handles]
    result = g.receiver.wait("t1", 30)
    assert result is not None and result.status == TransferStatus.DONE, result
    assert (result.num_tokens, result.first_token_id) == (15, 7)
    assert len(result.dst_block_ids) == 4 and g.pool.used_ids == set(result.dst_block_ids)
    for cache, heads in zip(g.dest_caches, g.dest_ranges):
        expected = _heads_of(cache_dtype, g.full, heads)
        assert torch.equal(cache[:, result.dst_block_ids], expected[:, src_blocks])     # values and scales
        untouched = [b for b in range(NUM_DST_BLOCKS) if b not in result.dst_block_ids]
        assert not cache[:, untouched].any()
    assert [r.transfer_id for r in g.receiver.poll()] == ["t1"]
    g.pool.free(result.dst_block_ids)
    assert_no_leak(g.pool)
    assert_copies_clean(g)


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("source,dest", [(2, 1), (1, 2)])
@pytest.mark.parametrize("kind", [NIXL])
def test_nixl_push_writes_each_copy_into_its_heads(groups, kind, source, dest, cache_dtype):
    """nixl's other mode: the sending rank WRITEs its heads' runs into the receiving rank's."""
    g = groups(kind, source, dest, cache_dtype=cache_dtype, mode="push")
    src_blocks = [2, 0, 5]
    handle = g.sender.send(KVPiece("r7", g.source_caches[0], src_blocks, transfer_id="t7", num_tokens=9,
                                   first_token_id=3), g.receiver.endpoint)
    assert handle.wait(30) == TransferStatus.DONE, handle.error
    result = g.receiver.wait("t7", 30)
    assert result is not None and result.status == TransferStatus.DONE, result
    for cache, heads in zip(g.dest_caches, g.dest_ranges):
        expected = g.full[:, :, :, heads.start:heads.stop] if cache_dtype == "auto" else \
            _heads_of(cache_dtype, g.full, heads)
        assert torch.equal(cache[:, result.dst_block_ids], expected[:, src_blocks])
    g.pool.free(result.dst_block_ids)
    assert_no_leak(g.pool)


def test_a_head_view_of_a_quantized_cache_is_the_cells_of_its_heads():
    cache = _quantized_cache("int8", torch.Generator().manual_seed(3))
    layout = _layouts(1, "int8")[0]
    view = head_view(cache, range(1, 2), layout)
    assert view.shape == head_layout(layout, range(1, 2)).cache_shape(NUM_SRC_BLOCKS)
    out = torch.empty(3 * 2 * view.shape[2], dtype=torch.uint8)
    get_codec("int8_cache").encode_from(view, (0, 3), torch.tensor([5, 0]), out)
    assert torch.equal(out.view(3, 2, -1), _heads_of("int8", cache, range(1, 2))[:, [5, 0]])
    with pytest.raises(ValueError, match=r"heads \[1, 3\) of a kv_cache.dtype int8 cache"):
        head_view(cache, range(1, 3), layout)


def test_a_head_view_s_cells_are_byte_runs_of_the_whole_cache():
    """What tcp and nixl move per (layer, block): K's and V's rows of the heads; a quantized cache's values of
    K and V, then their scales (int8 here: 4 tokens x 8 values a head, 4 float32 scales)."""
    plain = torch.zeros(3, NUM_SRC_BLOCKS, 2, 2, 4, 8)
    cells = CellRuns.of(head_view(plain, range(1, 2), _layouts(1)[0]))
    assert (cells.cell_bytes, cells.runs, cells.nbytes) == (512, ((128, 128), (384, 128)), 256)
    assert CellRuns.of(head_view(plain, range(0, 2), _layouts(1)[0])).runs == ((0, 512),)
    # layer 1, blocks 3 and 4: cells at (6 + 3) * 512 and (6 + 4) * 512
    assert cells.ranges((1, 2), [3, 4]) == [(4736, 4864), (4992, 5120), (5248, 5376), (5504, 5632)]
    assert CellRuns.of(head_view(plain, range(0, 1), _layouts(1)[0])).ranges((0, 1), [0]) == [(0, 128), (256, 384)]
    quantized = _format("int8", 2).allocate(NUM_SRC_BLOCKS, torch.device("cpu"))
    cells = CellRuns.of(head_view(quantized, range(1, 2), _layouts(1, "int8")[0]))
    assert (cells.cell_bytes, cells.runs) == (192, ((32, 32), (96, 32), (144, 16), (176, 16)))


@pytest.mark.parametrize("kind", ["tcp", NIXL])
def test_a_quantized_copy_is_refused_on_cache_dtype_and_head_range_naming_both(groups, kind):
    g = groups(kind, 1, 2, cache_dtype="int8")
    _, copies = parse_group_endpoint(g.receiver.endpoint)
    fp8 = ReshardedSender(_layouts(1, "fp8"), [_heads_of("fp8", _quantized_cache("fp8", torch.Generator()),
                                                         range(0, 2))],
                          lambda rank, heads, layout: make_sender(kind, layout, codec="fp8_cache", token=TOKEN))
    handle = fp8.send(KVPiece("r5", fp8.caches[0], [0], transfer_id="t5"), g.receiver.endpoint)
    assert handle.wait(30) == TransferStatus.FAILED
    assert "KV handshake mismatch on cache_dtype: sender='fp8' receiver='int8'" in handle.error
    fp8.close()
    wrong = copies[0]                        # model head 0's bytes to the receiver of model head 1
    layout = head_layout(_layouts(1, "int8")[0], wrong.source_heads)
    sender = make_sender(kind, layout, codec="int8_cache", token=TOKEN)
    view = head_view(g.source_caches[0], wrong.source_heads, layout)
    handle = sender.send(KVPiece("r6", view, [0], transfer_id="t6"), copies[1].endpoint)
    assert handle.wait(30) == TransferStatus.FAILED
    assert "KV handshake mismatch on KV heads: sender holds heads [0, 1) at tensor_parallel 1, receiver holds " \
           "heads [1, 2) at tensor_parallel 2" in handle.error
    sender.close()
    assert wait_for(lambda: g.pool.num_used == 0)


@pytest.mark.parametrize("source,dest", DEGREES)
def test_copies_of_a_transfer_are_one_per_planned_rank_pair(groups, source, dest):
    g = groups("fake", source, dest)
    degree, copies = parse_group_endpoint(g.receiver.endpoint)
    assert degree == source
    assert [(c.source_rank, c.dest_rank) for c in copies] == \
        [(c.source_rank, c.dest_rank) for c in reshard_plan(CFG, source, dest)]
    assert len({c.endpoint for c in copies}) == len(copies)


def test_a_copy_missing_expires_the_transfer_and_frees_its_blocks_once(groups):
    g = groups("tcp", 2, 1, deadline_s=0.5)
    _, copies = parse_group_endpoint(g.receiver.endpoint)
    c = copies[0]                            # only rank 0's heads are sent: the other copy never comes
    view = head_view(g.source_caches[c.source_rank], c.source_heads, _layouts(2)[c.source_rank])
    handle = g.sender._sender(c.source_rank, c.source_heads).send(
        KVPiece("r2", view, [0, 2], transfer_id="t2"), c.endpoint)
    assert handle.wait(30) == TransferStatus.DONE, handle.error
    result = g.receiver.wait("t2", 30)
    assert result is not None and result.status == TransferStatus.EXPIRED, result
    assert result.dst_block_ids == []
    assert wait_for(lambda: g.pool.num_used == 0)
    assert g.receiver.blocks.num_transfers == 0


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("kind", ["tcp", "torch", NIXL])
def test_cancel_mid_transfer_returns_every_block(groups, kind, cache_dtype):
    g = groups(kind, 1, 2, cache_dtype=cache_dtype)
    handle = g.sender.send(KVPiece("r3", g.source_caches[0], [0, 1, 2], transfer_id="t3", layers=(0, 1)),
                           g.receiver.endpoint)
    assert handle.wait(30) == TransferStatus.DONE, handle.error
    assert g.receiver.status("t3") == TransferStatus.TRANSFERRING
    assert g.receiver.cancel(transfer_id="t3") == ["t3"]
    result = g.receiver.wait("t3", 30)
    assert result is not None and result.status == TransferStatus.CANCELLED
    late = g.sender.send(KVPiece("r3", g.source_caches[0], [0, 1, 2], transfer_id="t3", layers=(1, 3)),
                         g.receiver.endpoint)
    assert late.wait(30) == TransferStatus.FAILED           # refused: nothing reserved again
    assert wait_for(lambda: g.pool.num_used == 0)
    assert_no_leak(g.pool)
    assert_copies_clean(g)


def test_a_sender_of_another_degree_is_refused_naming_both(groups):
    g = groups("fake", 2, 1)
    one = ReshardedSender(_layouts(1), [g.full.clone()], lambda rank, heads, layout: make_sender("fake", layout))
    handle = one.send(KVPiece("r4", one.caches[0], [0], transfer_id="t4"), g.receiver.endpoint)
    assert handle.status == TransferStatus.FAILED
    assert "expects KV from tensor_parallel 2; this sender is tensor_parallel 1" in handle.error
    one.close()
    assert_no_leak(g.pool)
