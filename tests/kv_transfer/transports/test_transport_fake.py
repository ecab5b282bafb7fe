"""Malformed frames through the fake transport's tamper hook: every one fails cleanly, nothing crashes,
no block leaks — three chosen defects, then 2,000 generated ones."""
from __future__ import annotations

import time
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_helpers import Pair, assert_no_leak, random_cache, wait_for
from kv_transfer import FakeHub, KVLayout, KVPiece, TransferStatus
from kv_transfer.wire import FRAME_PREFIX, WIRE_VERSION

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32)


@pytest.mark.parametrize("tamper, message", [
    (lambda frame: frame[:-3], "truncated chunk"),
    (lambda frame: frame.replace(b"\xa7version" + bytes([WIRE_VERSION]), b"\xa7version\x07"), "unknown wire version 7"),
    (lambda frame: FRAME_PREFIX.pack(1 << 30) + frame[4:], "header length"),
])
def test_malformed_frames_fail_cleanly(make_pair, layout, tamper, message):
    pair = make_pair("fake", layout, chunk_bytes=200)
    count = [0]

    def second_frame_tampered(frame):
        count[0] += 1
        return tamper(frame) if count[0] == 2 else frame

    pair.receiver.hub.tamper = second_frame_tampered
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 5), [0, 1, 2, 3]), pair.dest)
    assert handle.wait(10) == TransferStatus.FAILED and message in handle.error, handle
    assert pair.receiver.wait(handle.transfer_id, 5).status == TransferStatus.FAILED
    assert_no_leak(pair.pool)


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0.0, 0.999)),
    st.tuples(st.just("flip"), st.floats(0.0, 0.999), st.integers(1, 255)),
    st.tuples(st.just("garbage"), st.binary(min_size=0, max_size=64)),
    st.tuples(st.just("header_size"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("drop"), st.none()),
)


def _mutate(frame: bytes, m) -> bytes | None:
    kind, arg = m[0], m[1]
    if kind == "truncate":
        return frame[: int(arg * len(frame))]
    if kind == "flip":
        i = int(arg * len(frame))
        return frame[:i] + bytes([frame[i] ^ m[2]]) + frame[i + 1:]
    if kind == "garbage":
        return arg
    if kind == "header_size":                  # a length prefix that lies
        return arg.to_bytes(4, "little") + frame[4:]
    return None                                # the sender vanishes mid-stream


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(m=mutation, which=st.integers(0, 3), num_blocks=st.integers(1, 6))
def test_malformed_frames_fail_cleanly_without_leaks(m, which, num_blocks):
    pair = Pair("fake", LAYOUT, hub=FakeHub(), num_dst_blocks=16)
    try:
        _check_one(pair, m, which, num_blocks)
    finally:
        pair.close()


def _check_one(pair: Pair, m, which: int, num_blocks: int) -> None:
    src = random_cache(LAYOUT, 8)
    seen = [0]

    def tamper(frame: bytes):          # mutate frame number `which` (fewer frames: a clean transfer)
        seen[0] += 1
        return _mutate(frame, m) if seen[0] - 1 == which else frame
    pair.sender.hub.tamper = tamper
    rid = uuid.uuid4().hex
    handle = pair.sender.send(KVPiece(rid, src, list(range(num_blocks)), deadline_s=1.0), pair.dest)
    handle.wait(5)
    assert handle.done()
    results = _results(pair, handle.transfer_id, 3.0 if handle.status is TransferStatus.DONE else 0.05, rid)
    mutated = seen[0] > which
    ours = results.get(handle.transfer_id)
    if ours is not None and ours.status is TransferStatus.DONE:   # exact bytes, wherever the damage was
        assert torch.equal(pair.dst_cache[:, ours.dst_block_ids], src[:, :num_blocks]), m
    elif not mutated:
        raise AssertionError(f"a clean transfer did not complete: {ours}")
    if mutated and m[0] in ("truncate", "garbage", "drop"):
        assert ours is None or ours.status is not TransferStatus.DONE, (m, ours)
    # Every reserved block came back; only DONE transfers (possibly under a damaged id) own theirs,
    # which the decode worker frees as orphans when nobody claims them.
    def only_done_transfers_hold_blocks() -> bool:
        for r in pair.receiver.poll():
            results[r.transfer_id] = r
        owned = {b for r in results.values() if r.status is TransferStatus.DONE for b in r.dst_block_ids}
        return pair.pool.used_ids <= owned

    # (a damaged id may leave a transfer pending: its 1 s deadline expires it)
    assert wait_for(only_done_transfers_hold_blocks, 3.0), (m, sorted(pair.pool.used_ids))


def _results(pair: Pair, transfer_id: str, wait_s: float, request_id: str) -> dict:
    """Terminal reports by transfer id; ours is cancelled if it has not ended within `wait_s`."""
    results = {}
    end = time.monotonic() + wait_s
    while time.monotonic() < end and transfer_id not in results:
        for r in pair.receiver.poll():
            results[r.transfer_id] = r
        time.sleep(0.001)
    pair.receiver.cancel(transfer_id=transfer_id)
    pair.receiver.cancel(request_id=request_id)
    for r in pair.receiver.poll():
        results[r.transfer_id] = r
    return results
