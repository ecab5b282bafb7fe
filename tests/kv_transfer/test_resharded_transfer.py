"""KV transfer between tensor-parallel degrees: every receiving rank ends up with exactly its heads of the
sent blocks (the reshard plan's reference, `apply_plan`), over every transport and both codecs, streamed
layer by layer or in one piece; one block list shared by the receiving ranks; nothing left reserved when a
copy fails, expires or is cancelled."""
from __future__ import annotations

import pytest
import torch
from kv_helpers import TOKEN, assert_no_leak, wait_for

from engine.model.config import ModelConfig
from engine.parallel.reshard import reshard_plan
from engine.parallel.shard import kv_head_ranges
from kv_transfer import FakeHub, KVLayout, KVPiece, SimpleBlockPool, TransferStatus, get_codec
from kv_transfer import make_receiver, make_sender
from kv_transfer.resharded import ReshardedReceiver, ReshardedSender, head_view, parse_group_endpoint

CFG = ModelConfig("llama", 64, 128, 256, 3, 4, 2, 8, 128)       # 4 attention heads, 2 KV heads, 3 layers
NUM_SRC_BLOCKS, NUM_DST_BLOCKS = 6, 16


def _layouts(degree: int) -> list[KVLayout]:
    return [KVLayout(num_layers=3, num_kv_heads=len(r), block_size=4, head_dim=8, dtype=torch.float32,
                     model_fingerprint="tiny-tp", tensor_parallel=degree, kv_head_start=r.start)
            for r in kv_head_ranges(CFG, degree)]


class Groups:
    """A degree-`source` prefill side and a degree-`dest` decode side of one transport, in this process."""

    def __init__(self, kind: str, source: int, dest: int, codec: str = "none", deadline_s: float = 30.0):
        generator = torch.Generator().manual_seed(10 * source + dest)
        self.full = torch.randn(3, NUM_SRC_BLOCKS, 2, 2, 4, 8, generator=generator)
        self.source_caches = [self.full[:, :, :, r.start:r.stop].clone() for r in kv_head_ranges(CFG, source)]
        self.dest_ranges = kv_head_ranges(CFG, dest)
        self.dest_caches = [torch.zeros(3, NUM_DST_BLOCKS, 2, len(r), 4, 8) for r in self.dest_ranges]
        self.pool = SimpleBlockPool(NUM_DST_BLOCKS)
        extra = {"hub": FakeHub()} if kind == "fake" else {}
        self.receiver = ReshardedReceiver.open(
            reshard_plan(CFG, source, dest), source, _layouts(dest), self.pool,
            lambda c, layout, blocks, done: make_receiver(
                kind, layout, head_view(self.dest_caches[c.dest_rank], c.dest_heads), blocks, done, codec=codec,
                token=TOKEN, **extra), deadline_s=deadline_s)
        self.sender = ReshardedSender(_layouts(source), self.source_caches,
                                      lambda rank, heads, layout: make_sender(kind, layout, codec=codec, token=TOKEN,
                                                                              **extra))

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


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
@pytest.mark.parametrize("kind", ["tcp", "grpc", "torch"])
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
    view = g.source_caches[c.source_rank][:, :, :, c.source_heads.start:c.source_heads.stop]
    handle = g.sender._sender(c.source_rank, c.source_heads).send(
        KVPiece("r2", view, [0, 2], transfer_id="t2"), c.endpoint)
    assert handle.wait(30) == TransferStatus.DONE, handle.error
    result = g.receiver.wait("t2", 30)
    assert result is not None and result.status == TransferStatus.EXPIRED, result
    assert result.dst_block_ids == []
    assert wait_for(lambda: g.pool.num_used == 0)
    assert g.receiver.blocks.num_transfers == 0


@pytest.mark.parametrize("kind", ["tcp", "torch"])
def test_cancel_mid_transfer_returns_every_block(groups, kind):
    g = groups(kind, 1, 2)
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


def test_a_sender_of_another_degree_is_refused_naming_both(groups):
    g = groups("fake", 2, 1)
    one = ReshardedSender(_layouts(1), [g.full.clone()], lambda rank, heads, layout: make_sender("fake", layout))
    handle = one.send(KVPiece("r4", one.caches[0], [0], transfer_id="t4"), g.receiver.endpoint)
    assert handle.status == TransferStatus.FAILED
    assert "expects KV from tensor_parallel 2; this sender is tensor_parallel 1" in handle.error
    one.close()
    assert_no_leak(g.pool)
