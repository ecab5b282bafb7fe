"""The handshake's tensor-parallel fields: each end says its degree and KV-head range, and ends holding
different heads are refused on every transport, naming both (the degrees may differ, the heads may not)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_helpers import assert_no_leak, random_cache

from kv_transfer import HandshakeError, KVLayout, KVPiece, TransferStatus, check_compatible, layout_of
from engine.parallel.shard import HeadShard


def test_layout_of_a_rank_carries_its_degree_and_first_kv_head():
    cache = torch.zeros(3, 5, 2, 1, 4, 8)                       # rank 1 of 2: one of the model's 2 KV heads
    shard = HeadShard(rank=1, size=2, num_heads=2, num_kv_heads=1, head_start=2, kv_head_start=1,
                      intermediate_size=64, intermediate_start=64)
    layout = layout_of(cache, "fp", shard=shard)
    assert (layout.tensor_parallel, layout.kv_head_start, layout.num_kv_heads) == (2, 1, 1)
    described = layout.describe("none")
    assert (described["tensor_parallel"], described["kv_head_start"]) == (2, 1)
    check_compatible(described, dict(described))


def test_ends_holding_other_heads_are_refused_naming_both(layout):
    rank0 = dataclasses.replace(layout, num_kv_heads=1, tensor_parallel=2)
    with pytest.raises(HandshakeError, match=r"sender holds heads \[0, 1\) at tensor_parallel 2, receiver holds "
                                             r"heads \[0, 2\) at tensor_parallel 1"):
        check_compatible(rank0.describe("none"), layout.describe("none"))
    rank1 = dataclasses.replace(rank0, kv_head_start=1)
    with pytest.raises(HandshakeError, match=r"sender holds heads \[1, 2\) .* receiver holds heads \[0, 1\)"):
        check_compatible(rank1.describe("none"), rank0.describe("none"))


@pytest.mark.parametrize("malformed, message", [
    ("a layout", "sender's layout is not a map (got str)"),
    ({"kv_head_start": "x", "num_kv_heads": 1}, "sender's kv_head_start is 'x', not an integer"),
    ({"kv_head_start": None}, "sender's kv_head_start is None, not an integer"),
    ({"num_layers": True}, "sender's num_layers is True, not an integer"),
])
def test_a_malformed_description_is_a_handshake_error_naming_the_field(layout, malformed, message):
    """What a peer sends is checked before it is compared (it used to raise TypeError or AttributeError)."""
    remote = malformed if isinstance(malformed, str) else {**layout.describe("none"), **malformed}
    with pytest.raises(HandshakeError) as exc:
        check_compatible(remote, layout.describe("none"))
    assert message in str(exc.value)


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch", "ray"])
def test_every_transport_refuses_a_degree_it_cannot_map(make_pair, layout, kind):
    sender_layout = KVLayout(layout.num_layers, 1, layout.block_size, layout.head_dim, layout.dtype,
                             layout.model_fingerprint, tensor_parallel=2, kv_head_start=1)
    pair = make_pair(kind, sender_layout, receiver_layout=layout)
    handle = pair.sender.send(KVPiece("r", random_cache(sender_layout, 3), [0, 1]), pair.dest)
    assert handle.wait(30) == TransferStatus.FAILED
    assert "sender holds heads [1, 2) at tensor_parallel 2" in handle.error, handle.error
    assert "receiver holds heads [0, 2) at tensor_parallel 1" in handle.error, handle.error
    assert pair.receiver.stats.handshake_failures == 1
    assert_no_leak(pair.pool)
