"""BaseReceiver: blocks are freed only after the writes into them, cancel, DONE ownership, partial layers.

Through the fake transport where a sender is needed; every transport shares this code.
"""

from __future__ import annotations

import threading
import time

import torch
from kv_helpers import assert_no_leak, random_cache

from kv_transfer import KVPiece, SimpleBlockPool, TransferError, TransferStatus
from kv_transfer.chunker import encode_chunks
from kv_transfer.codec import NoneCodec, get_codec
from kv_transfer.receiver import BaseReceiver


def test_a_failure_frees_blocks_only_after_the_writes_into_them(layout, monkeypatch):
    """Chunks decode into the cache outside the transfer's lock; failing the transfer meanwhile
    must not hand the blocks to someone else until those writes are done."""
    pool = SimpleBlockPool(8)
    core = BaseReceiver(layout, torch.zeros(layout.cache_shape(8), dtype=layout.dtype), pool)
    entered, release = threading.Event(), threading.Event()
    real = NoneCodec.decode_into

    def slow_decode_into(self, *args, **kwargs):
        entered.set()
        release.wait(10)
        real(self, *args, **kwargs)

    monkeypatch.setattr(NoneCodec, "decode_into", slow_decode_into)
    chunk = next(encode_chunks(KVPiece("r", random_cache(layout, 3), [0, 1, 2], transfer_id="t"), layout,
                               get_codec("none"), deadline_at=time.monotonic() + 30, chunk_bytes=1 << 20))
    refused = []

    def write() -> None:
        try:
            core.accept(chunk.header, chunk.payload)
        except TransferError as exc:  # the transfer failed while this chunk was being written
            refused.append(str(exc))

    writer = threading.Thread(target=write)
    writer.start()
    assert entered.wait(5) and pool.num_used == 3
    failer = threading.Thread(target=core.fail, args=("t", "failed by the test"))
    failer.start()
    failer.join(0.3)
    assert failer.is_alive() and pool.num_used == 3  # waiting for the write to drain
    release.set()
    failer.join(5)
    writer.join(5)
    assert pool.num_used == 0 and refused and "failed by the test" in refused[0]
    assert core.wait("t", 1).status == TransferStatus.FAILED
    core.close()



def test_partial_layers_stay_pending_until_all_arrive(make_pair, layout):
    pair = make_pair("fake", layout)
    src = random_cache(layout, 4)
    first = KVPiece("r", src, [1, 2], transfer_id="t", layers=(0, 2))
    assert pair.sender.send(first, pair.dest).wait(5) == TransferStatus.DONE
    assert pair.receiver.status("t") == TransferStatus.TRANSFERRING
    assert pair.receiver.poll() == []
    rest = KVPiece("r", src, [1, 2], transfer_id="t", layers=(2, 3))
    assert pair.sender.send(rest, pair.dest).wait(5) == TransferStatus.DONE
    [result] = pair.receiver.poll()
    assert (result.transfer_id, result.status, result.dst_block_ids) == ("t", TransferStatus.DONE, [0, 1])



def test_cancel_by_request_and_by_transfer_id(make_pair, layout):
    pair = make_pair("fake", layout)
    src = random_cache(layout, 6)
    pair.sender.send(KVPiece("victim", src, [0, 1], transfer_id="a", layers=(0, 1)), pair.dest).wait(5)
    pair.sender.send(KVPiece("other", src, [2, 3, 4], transfer_id="b", layers=(0, 1)), pair.dest).wait(5)
    assert pair.pool.num_used == 5
    assert pair.receiver.cancel(request_id="victim") == ["a"]
    assert_no_leak(pair.pool, [2, 3, 4])
    assert pair.receiver.cancel(transfer_id="b") == ["b"]
    assert_no_leak(pair.pool)
    assert {(r.transfer_id, r.status) for r in pair.receiver.poll()} == {("a", TransferStatus.CANCELLED),
                                                                         ("b", TransferStatus.CANCELLED)}
    # cancelling before the first chunk arrives: later chunks are refused, nothing is reserved
    assert pair.receiver.cancel(transfer_id="c") == []
    late = pair.sender.send(KVPiece("x", src, [0], transfer_id="c"), pair.dest)
    assert late.wait(5) == TransferStatus.FAILED and "cancelled" in late.error
    assert_no_leak(pair.pool)



def test_done_blocks_belong_to_the_decode_worker(make_pair, layout):
    pair = make_pair("fake", layout)
    seen = []
    pair.receiver.on_complete = seen.append
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 3), [2, 0], transfer_id="t"), pair.dest)
    assert handle.wait(5) == TransferStatus.DONE
    assert pair.receiver.cancel(transfer_id="t") == []  # DONE is final: cancel frees nothing
    assert pair.pool.used_ids == {0, 1}
    assert [(r.transfer_id, r.dst_block_ids) for r in seen] == [("t", [0, 1])]
    assert_no_leak(pair.pool, [0, 1])
