"""The KV service's bounds (kv_transfer/transports/grpc.py): the token is checked before a body is
read, a Handshake is a few KiB and a malformed one a clear refusal, a frame the receiver's ``max_payload``,
at most ``max_calls`` calls run at once, and none for ever."""

from __future__ import annotations

import threading
import time

import grpc
import msgpack
import pytest
import torch
from kv_helpers import TOKEN, assert_no_leak, random_cache, wait_for

from kv_transfer import KVPiece, SimpleBlockPool, TransferStatus, make_receiver, make_sender
from kv_transfer.transports.grpc import END_FRAME, MAX_MESSAGE_BYTES, SERVICE
from kv_transfer.wire import TOKEN_KEY

_UNLIMITED_SEND = [("grpc.max_send_message_length", -1)]


def _receiver(layout, **options):
    return make_receiver("grpc", layout, torch.zeros(layout.cache_shape(8)), SimpleBlockPool(8), token=TOKEN,
                         **options)


@pytest.fixture
def receiver(layout):
    receiver = _receiver(layout)
    yield receiver
    receiver.close()


def _handshake_code(endpoint: str, body: bytes, token: str) -> grpc.StatusCode:
    with grpc.insecure_channel(endpoint, options=_UNLIMITED_SEND) as channel:
        try:
            channel.unary_unary(f"/{SERVICE}/Handshake")(body, metadata=((TOKEN_KEY, token),), timeout=60)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_wrong_token_is_refused_before_the_body_is_read(receiver):
    # One byte over the largest message the service reads: had it read the body before the
    # token, the answer would be RESOURCE_EXHAUSTED ("larger than max").
    body = bytes(MAX_MESSAGE_BYTES + 1)   # zero pages: cheap until gRPC copies them
    assert _handshake_code(receiver.endpoint, body, "not-the-token") == grpc.StatusCode.UNAUTHENTICATED
    assert _handshake_code(receiver.endpoint, b"", "") == grpc.StatusCode.UNAUTHENTICATED
    assert receiver.stats.auth_failures == 2


def test_handshake_over_a_few_kib_is_refused(receiver, layout):
    assert _handshake_code(receiver.endpoint, msgpack.packb(layout.describe("none")), TOKEN) == grpc.StatusCode.OK
    assert _handshake_code(receiver.endpoint, bytes(8192), TOKEN) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert receiver.stats.auth_failures == 0


def test_a_malformed_handshake_is_refused_naming_the_field(receiver, layout):
    body = msgpack.packb({**layout.describe("none"), "kv_head_start": None})
    with grpc.insecure_channel(receiver.endpoint) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            channel.unary_unary(f"/{SERVICE}/Handshake")(body, metadata=((TOKEN_KEY, TOKEN),), timeout=10)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION       # was UNKNOWN, with a traceback
    assert "kv_head_start is None, not an integer" in exc.value.details()
    assert receiver.stats.handshake_failures == 1
    assert _handshake_code(receiver.endpoint, msgpack.packb(layout.describe("none")), TOKEN) == grpc.StatusCode.OK


def test_a_frame_over_the_receivers_max_payload_is_refused_unread(layout):
    receiver = _receiver(layout, max_payload=64 << 10)
    accepted = []
    receiver.accept = lambda header, payload: accepted.append(header)
    try:
        with grpc.insecure_channel(receiver.endpoint, options=_UNLIMITED_SEND) as channel:
            push = channel.stream_unary(f"/{SERVICE}/PushKV")
            with pytest.raises(grpc.RpcError) as exc:       # a frame of 1 MiB: was read whole, then refused
                push(iter([bytes(1 << 20), END_FRAME]), metadata=((TOKEN_KEY, TOKEN),), timeout=10)
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value.details()
            assert msgpack.unpackb(push(iter([END_FRAME]), metadata=((TOKEN_KEY, TOKEN),), timeout=10)) == \
                {"nbytes": 0}
        assert accepted == []
    finally:
        receiver.close()


def test_a_silent_call_without_a_deadline_is_cancelled_and_frees_its_stream(layout):
    pool = SimpleBlockPool(8)
    receiver = make_receiver("grpc", layout, torch.zeros(layout.cache_shape(8)), pool, token=TOKEN, max_streams=1,
                             default_timeout_s=0.5)
    sender = make_sender("grpc", layout, token=TOKEN)
    release = threading.Event()

    def silent():                 # opens the stream, then sends nothing (and the call has no deadline)
        release.wait(60)
        yield END_FRAME

    try:
        with grpc.insecure_channel(receiver.endpoint) as channel:
            call = channel.stream_unary(f"/{SERVICE}/PushKV").future(silent(), metadata=((TOKEN_KEY, TOKEN),))
            assert wait_for(call.done, timeout=10)         # was: held the only stream thread for ever
            assert call.code() == grpc.StatusCode.CANCELLED
        handle = sender.send(KVPiece("r", random_cache(layout, 3), [0, 2]), receiver.endpoint)
        assert handle.wait(30) == TransferStatus.DONE, handle
        assert_no_leak(pool, receiver.wait(handle.transfer_id, 5).dst_block_ids)
    finally:
        release.set()
        sender.close()
        receiver.close()


def _held_pair_and_a_refused_call(push, metadata) -> bool:
    """Opens two calls that hold their stream, then calls until one is refused; True when both held
    calls were the ones in (they finish after release). A held call can lose the race to a probe
    that is still counted: the service refuses it instead, and the pair is tried again."""
    release = threading.Event()

    def held_frames():            # a sender that has opened its stream and not sent a frame yet
        release.wait(30)
        yield END_FRAME

    held = [push.future(held_frames(), metadata=metadata, timeout=30) for _ in range(2)]
    code, end = grpc.StatusCode.OK, time.monotonic() + 10
    try:
        while code == grpc.StatusCode.OK and time.monotonic() < end and not any(call.done() for call in held):
            try:
                push(iter([END_FRAME]), metadata=metadata, timeout=10)
            except grpc.RpcError as exc:
                code = exc.code()
    finally:
        release.set()
    results = []
    for call in held:
        try:
            results.append(msgpack.unpackb(call.result(timeout=10)))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED   # refused for the limit, not lost
            results.append(None)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED)
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and results == [{"nbytes": 0}] * 2


def test_calls_over_max_calls_are_refused(layout):
    receiver = _receiver(layout, max_calls=2)
    try:
        with grpc.insecure_channel(receiver.endpoint) as channel:
            push = channel.stream_unary(f"/{SERVICE}/PushKV")
            metadata = ((TOKEN_KEY, TOKEN),)
            assert any(_held_pair_and_a_refused_call(push, metadata) for _ in range(10))
            push(iter([END_FRAME]), metadata=metadata, timeout=10)        # room again once they finished
    finally:
        receiver.close()


def test_a_push_call_starts_no_thread_of_its_own(layout, monkeypatch):
    """The bound on a call's life is kept by the receiver's one reaper thread, not by a timer thread per
    PushKV call (a transfer makes one to num_streams calls)."""
    pool = SimpleBlockPool(8)
    receiver = make_receiver("grpc", layout, torch.zeros(layout.cache_shape(8)), pool, token=TOKEN, decode_threads=1)
    sender = make_sender("grpc", layout, token=TOKEN)
    started, start = [], threading.Thread.start

    def record(thread):
        started.append((threading.current_thread().name, thread.name))
        start(thread)

    def transfer(seed: int) -> None:
        handle = sender.send(KVPiece(f"r{seed}", random_cache(layout, 3, seed), [0, 2]), receiver.endpoint)
        assert handle.wait(30) == TransferStatus.DONE, handle
        pool.free(receiver.wait(handle.transfer_id, 5).dst_block_ids)

    try:
        transfer(0)                                   # the pools' threads exist from here on
        monkeypatch.setattr(threading.Thread, "start", record)
        for seed in range(1, 4):
            transfer(seed)
        monkeypatch.undo()
        assert [name for caller, name in started if caller.startswith("kv-grpc_")] == []   # the service's threads
        assert_no_leak(pool)
    finally:
        monkeypatch.undo()
        sender.close()
        receiver.close()
