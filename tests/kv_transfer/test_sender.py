"""BaseSender: after a piece ends, the sender holds no reference to the prefill cache."""

from __future__ import annotations

import gc
import weakref

from kv_helpers import random_cache, wait_for

from kv_transfer import KVPiece, TransferStatus


def test_sender_drops_the_cache_after_done(make_pair, layout):
    pair = make_pair("grpc", layout)
    src = random_cache(layout, 4)
    ref = weakref.ref(src)
    assert pair.sender.send(KVPiece("r", src, [1, 3]), pair.dest).wait(10) == TransferStatus.DONE
    del src
    gc.collect()
    assert wait_for(lambda: ref() is None, 2), "sender still holds the prefill cache"


def test_a_sender_keeps_state_for_a_bounded_number_of_destinations(layout, monkeypatch):
    """Per-destination state (handshakes, gRPC channels) stays bounded: only the newest destinations keep it."""
    from kv_transfer import sender as sender_module
    from kv_transfer.transports.grpc import GrpcSender
    monkeypatch.setattr(sender_module, "MAX_DESTINATIONS", 3)
    sender = GrpcSender(layout, token="t")
    monkeypatch.setattr(GrpcSender, "_remote_handshake", lambda self, dest, local: local)
    try:
        for i in range(10):
            dest = f"127.0.0.1:{40000 + i}"
            sender._channel(dest)
            sender.handshake(dest)
        assert len(sender._handshaken) == 3 and set(sender._channels) == set(sender._handshaken)
        assert list(sender._handshaken) == [f"127.0.0.1:{40000 + i}" for i in (7, 8, 9)]
    finally:
        sender.close()
