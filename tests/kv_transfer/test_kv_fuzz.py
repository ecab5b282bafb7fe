"""2,000 malformed KV-transfer messages: every one fails cleanly, nothing crashes, no block leaks."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Pair, assert_no_leak, random_cache
from kv_transfer import KVLayout, TransferStatus

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32)

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
    pair = _pair()
    src = random_cache(LAYOUT, 8)
    seen = [0]

    def tamper(frame: bytes):          # mutate frame number `which` (fewer frames: a clean transfer)
        seen[0] += 1
        return _mutate(frame, m) if seen[0] - 1 == which else frame
    pair.hub.tamper = tamper
    handle = pair.sender.send("req", src, list(range(num_blocks)), pair.dest, deadline_s=2.0)
    handle.wait(5)
    assert handle.done()
    if seen[0] > which and m[0] != "flip":
        assert handle.status is not TransferStatus.DONE, (m, handle)
    pair.receiver.cancel(request_id="req")          # whatever is still pending gives its blocks back
    owned = []
    for result in pair.receiver.poll():
        if result.status is TransferStatus.DONE:      # an untouched frame: exact bytes, blocks handed over
            assert torch.equal(pair.dst_cache[:, result.dst_block_ids], src[:, :num_blocks])
            owned += result.dst_block_ids
    assert_no_leak(pair.pool, owned)
    pair.pool.free(owned)


_PAIR: list[Pair] = []


def _pair() -> Pair:
    if not _PAIR:
        from kv_transfer import FakeHub
        hub = FakeHub()
        p = Pair("fake", LAYOUT, hub=hub, num_dst_blocks=32)
        p.hub = hub
        _PAIR.append(p)
    return _PAIR[0]


def teardown_module():
    for p in _PAIR:
        p.close()
    _PAIR.clear()

