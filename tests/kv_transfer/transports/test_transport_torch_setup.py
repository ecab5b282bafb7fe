"""torch pair set-up and teardown are bounded: a peer that never joins the group costs a send its deadline
(not a day), a sender that never joins frees the receiver's group slot, and closing a sender whose
receiver hangs returns."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from kv_helpers import TOKEN, assert_no_leak, random_cache, wait_for

from kv_transfer import FailedSide, KVPiece, SimpleBlockPool, TransferStatus, make_receiver, make_sender
from kv_transfer.transports.torch import receiver as torch_receiver
from kv_transfer.transports.torch import sender as torch_sender

SLACK_S = 3.0  # a busy 2-core machine; the bug is a one-day wait


@pytest.fixture
def release():
    """Set at teardown: whatever a test made hang gives up."""
    event = threading.Event()
    yield event
    event.set()


def new_receiver(layout, pool, **kwargs):
    cache = torch.zeros(layout.cache_shape(pool.num_blocks), dtype=layout.dtype)
    return make_receiver("torch", layout, cache, pool, token=TOKEN, **kwargs)


def test_a_peer_that_never_joins_the_group_fails_the_send_within_its_deadline(layout, monkeypatch, release):
    def never_joins(*args, **kwargs):  # the decode side answered the hello, then never built its group
        release.wait(60)
        raise RuntimeError("the test's receiver never joined")

    monkeypatch.setattr(torch_receiver, "make_group", never_joins)
    pool = SimpleBlockPool(8)
    receiver = new_receiver(layout, pool)
    sender = make_sender("torch", layout, token=TOKEN, connect_timeout_s=30)
    try:
        start = time.monotonic()
        handle = sender.send(KVPiece("r", random_cache(layout, 4), [0, 1], deadline_s=2.0), receiver.endpoint)
        assert handle.wait(2.0 + SLACK_S) in (TransferStatus.FAILED, TransferStatus.EXPIRED), handle
        assert time.monotonic() - start < 2.0 + SLACK_S
        assert handle.failed_side == FailedSide.TRANSPORT and "set-up" in handle.error, handle
        assert sender.num_groups == 0
        assert_no_leak(pool)
    finally:
        release.set()
        sender.close()
        receiver.close()


def test_a_sender_that_never_joins_frees_the_receivers_group_slot(layout, monkeypatch):
    """The receiver bounds its own set-up by its transfer deadline: with room for one group, a sender
    that read the reply and died must not keep the next one out."""
    pool = SimpleBlockPool(8)
    receiver = new_receiver(layout, pool, max_groups=1, default_timeout_s=1.0)

    def dies(*args, **kwargs):
        raise RuntimeError("the sender died before joining its group")

    monkeypatch.setattr(torch_sender, "make_group", dies)
    dead = make_sender("torch", layout, token=TOKEN)
    sender = make_sender("torch", layout, token=TOKEN, connect_timeout_s=30)
    try:
        doomed = KVPiece("r", random_cache(layout, 4), [0, 1])
        assert dead.send(doomed, receiver.endpoint).wait(10) == TransferStatus.FAILED
        monkeypatch.undo()
        src = random_cache(layout, 4)

        def pairs() -> bool:  # refused ("1 peer groups") until the dead pair's set-up gives up
            piece = KVPiece("r", src, [0, 1], deadline_s=10)
            return sender.send(piece, receiver.endpoint).wait(10) == TransferStatus.DONE

        assert wait_for(pairs, timeout=1.0 + SLACK_S), "the dead sender's group slot was never freed"
    finally:
        dead.close()
        sender.close()
        receiver.close()


def test_closing_a_sender_whose_receiver_hangs_returns(layout, monkeypatch, release):
    def hangs(self, *args):  # the pair is up, then the decode side stops reading it
        release.wait(60)

    monkeypatch.setattr(torch_receiver.TorchReceiver, "_serve", hangs)
    pool = SimpleBlockPool(8)
    receiver = new_receiver(layout, pool)
    sender = make_sender("torch", layout, token=TOKEN)
    try:
        sender.handshake(receiver.endpoint)
        assert sender.num_groups == 1
        closer = threading.Thread(target=sender.close, daemon=True)
        closer.start()
        closer.join(2.0 + SLACK_S)  # teardown is bounded by a constant (2 s), not the group's timeout
        assert not closer.is_alive(), "sender.close() hangs on a receiver that stopped reading"
        assert sender.num_groups == 0
    finally:
        release.set()
        receiver.close()
