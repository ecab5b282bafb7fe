"""16 concurrent transfers into one receiver: interleaved chunks land in the right blocks."""

from __future__ import annotations

import threading

import pytest
import torch
from kv_helpers import TOKEN, assert_no_leak, random_cache

from kv_transfer import KVPiece, TransferStatus, make_sender

NUM_TRANSFERS = 16


@pytest.mark.parametrize("kind", ["fake", "grpc", "tcp", "torch"])
def test_sixteen_concurrent_transfers(make_pair, layout, kind):
    # One sender per "prefill actor" on threads, so chunks of different requests interleave.
    pair = make_pair(kind, layout, num_dst_blocks=NUM_TRANSFERS * 3 + 5, chunk_bytes=200, max_workers=NUM_TRANSFERS)
    pair.pool.take([0, 7, 20])
    sources = [random_cache(layout, 5, seed=i) for i in range(NUM_TRANSFERS)]
    block_ids = [[(i + k) % 5 for k in range(3)][:: 1 if i % 2 else -1] for i in range(NUM_TRANSFERS)]
    arrivals = []
    lock = threading.Lock()
    original_begin_write = pair.receiver.begin_write

    def recording_begin_write(header):  # every transport writes each chunk between begin_write and end_write
        with lock:
            arrivals.append(header.request_id)
        return original_begin_write(header)

    pair.receiver.begin_write = recording_begin_write
    # four prefill actors (four torch pairs), four transfers each
    extra = {"hub": pair.receiver.hub} if kind == "fake" else {}
    senders = [pair.sender] + [make_sender(kind, layout, token=TOKEN, chunk_bytes=200, max_workers=4, **extra)
                               for _ in range(3)]
    handles = [senders[i % 4].send(KVPiece(f"req-{i}", sources[i], block_ids[i], num_tokens=100 + i), pair.dest)
               for i in range(NUM_TRANSFERS)]
    for handle in handles:
        assert handle.wait(60) == TransferStatus.DONE, handle
    results = {r.request_id: r for r in (pair.receiver.wait(h.transfer_id, 10) for h in handles)}
    owned = []
    for i in range(NUM_TRANSFERS):
        result = results[f"req-{i}"]
        assert result.status == TransferStatus.DONE and result.num_tokens == 100 + i
        expected = sources[i][:, block_ids[i]]
        assert torch.equal(pair.dst_cache[:, result.dst_block_ids], expected)
        owned += result.dst_block_ids
    assert len(set(owned)) == len(owned) == NUM_TRANSFERS * 3 and not set(owned) & {0, 7, 20}
    switches = sum(a != b for a, b in zip(arrivals, arrivals[1:]))
    assert switches > NUM_TRANSFERS, "chunks of different requests never interleaved"
    for sender in senders[1:]:
        sender.close()
    assert_no_leak(pair.pool, owned + [0, 7, 20])
    assert {r.request_id for r in pair.receiver.poll()} == set(results)
