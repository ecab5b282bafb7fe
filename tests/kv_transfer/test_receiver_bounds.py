"""BaseReceiver bounds what a first chunk may claim: blocks within its own token count and the pool share
it is granted, a deadline no longer than the receiver's own; later chunks must agree with the first.

Headers are forged on the way through the fake transport (``FakeHub.tamper``), re-packed so they pass
every wire check, as a buggy or hostile prefill actor holding the token could send them.
"""

from __future__ import annotations

from kv_helpers import assert_no_leak, random_cache

from kv_transfer import FailedSide, KVPiece, TransferStatus
from kv_transfer.wire import pack_frame, pack_header, split_frame

SLACK_S = 3.0


def forge(only_chunk: int | None = None, **fields):
    """A tamper hook that rewrites header fields (of every chunk, or of chunk ``only_chunk``)."""

    def tamper(frame: bytes) -> bytes:
        header, payload = split_frame(frame)
        if only_chunk is None or header.chunk_index == only_chunk:
            for name, value in fields.items():
                setattr(header, name, value)
        return pack_frame(pack_header(header), payload)

    return tamper


def assert_refused(pair, handle, words: str) -> None:
    assert handle.wait(10) == TransferStatus.FAILED, handle
    assert handle.failed_side == FailedSide.RECEIVER and words in handle.error, handle
    result = pair.receiver.wait(handle.transfer_id, 5)
    assert result.status == TransferStatus.FAILED and words in result.error
    assert_no_leak(pair.pool)


def test_more_blocks_than_the_headers_tokens_fill_are_refused(make_pair, layout):
    pair = make_pair("fake", layout, num_dst_blocks=64)
    pair.receiver.hub.tamper = forge(num_blocks=60)  # 60 of 64 free blocks for a 2-block, 8-token prompt
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 4), [0, 1], num_tokens=8), pair.dest)
    assert_refused(pair, handle, "num_blocks 60")


def test_more_blocks_than_the_pool_share_are_refused(make_pair, layout):
    pair = make_pair("fake", layout, num_dst_blocks=64, receiver_options={"max_blocks_share": 0.25})
    pair.receiver.hub.tamper = forge(num_blocks=60, num_tokens=60 * layout.block_size)  # self-consistent
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 4), [0, 1], num_tokens=8), pair.dest)
    assert_refused(pair, handle, "at most 16")
    pair.receiver.hub.tamper = None
    ok = pair.sender.send(KVPiece("r", random_cache(layout, 20), list(range(16))), pair.dest)  # the share is fine
    assert ok.wait(10) == TransferStatus.DONE, ok
    assert_no_leak(pair.pool, pair.receiver.wait(ok.transfer_id, 5).dst_block_ids)


def test_a_day_long_deadline_is_clamped_to_the_receivers(make_pair, layout):
    pair = make_pair("fake", layout, receiver_options={"default_timeout_s": 1.0})
    pair.receiver.hub.tamper = forge(deadline_ms=24 * 3600 * 1000)
    src = random_cache(layout, 4)
    handle = pair.sender.send(KVPiece("r", src, [0, 1, 2], layers=(0, 1)), pair.dest)  # the other layers never come
    assert handle.wait(10) == TransferStatus.DONE, handle
    assert pair.pool.num_used == 3
    result = pair.receiver.wait(handle.transfer_id, 1.0 + SLACK_S)
    assert result is not None and result.status == TransferStatus.EXPIRED, result
    assert_no_leak(pair.pool)


def test_a_later_chunk_that_disagrees_with_the_first_is_refused(make_pair, layout):
    pair = make_pair("fake", layout, chunk_bytes=200)
    pair.receiver.hub.tamper = forge(only_chunk=1, num_blocks=3)  # the first chunk reserved 2
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 4), [0, 1], layers=(0, 1)), pair.dest)
    assert_refused(pair, handle, "its transfer has")
