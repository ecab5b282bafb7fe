"""Receivers keep no state for senders that died: after failed, silent or killed senders, the torch
receiver's pairs (their threads, groups and rendezvous key spaces) and hello slots, and the ray receiver's
piece state and inbox acks, return to empty."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import torch
from kv_helpers import TOKEN, assert_no_leak, random_cache, wait_for

from kv_transfer import KVPiece, SimpleBlockPool, TransferStatus, get_codec, make_receiver, make_sender
from kv_transfer.chunker import encode_chunks
from kv_transfer.transports.tcp.protocol import NONCE_BYTES, recv_exact, send_small
from kv_transfer.transports.torch import sender as torch_sender

HELPER = os.path.join(os.path.dirname(__file__), "kv_killed_sender.py")


def torch_state(receiver) -> dict:
    """Entries the torch receiver holds: pairs (thread, group, key space, connection), hellos, transfers."""
    spaces = [pair.space for pair in receiver._pairs.values()]
    return {"pairs": len(receiver._pairs), "groups": receiver.num_groups, "hellos": len(receiver._slots),
            "stored_bytes": sum(space.nbytes for space in spaces), "transfers": receiver.num_active}


def rogue_connection(endpoint: str) -> socket.socket:
    host, _, port = endpoint.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=10)
    recv_exact(conn, NONCE_BYTES)  # the challenge
    return conn


def test_torch_receiver_state_returns_to_empty_after_dead_senders(layout, monkeypatch):
    pool = SimpleBlockPool(16)
    cache = torch.zeros(layout.cache_shape(16), dtype=layout.dtype)
    receiver = make_receiver("torch", layout, cache, pool, token=TOKEN, hello_timeout_s=0.5, default_timeout_s=3.0)
    silent = rogue_connection(receiver.endpoint)  # reads the challenge, never says hello
    forged = rogue_connection(receiver.endpoint)  # says hello, never reads the reply
    send_small(forged, {"nonce": "00", "proof": "forged", "layout": {}, "backend": "gloo"})
    killed = [subprocess.Popen([sys.executable, HELPER, "torch", receiver.endpoint, TOKEN, f"killed-{i}"],
                               stdout=subprocess.PIPE, text=True) for i in range(2)]
    sender = make_sender("torch", layout, token=TOKEN)
    try:
        def dies(*args, **kwargs):
            raise RuntimeError("the sender died before joining its group")

        monkeypatch.setattr(torch_sender, "make_group", dies)  # reads its reply, never joins
        dead = make_sender("torch", layout, token=TOKEN)
        doomed = KVPiece("r", random_cache(layout, 4), [0, 1])
        assert dead.send(doomed, receiver.endpoint).wait(10) == TransferStatus.FAILED
        dead.close()
        monkeypatch.undo()
        for process in killed:  # senders killed mid-transfer
            assert process.stdout.readline().strip() == "SENT"
        assert wait_for(lambda: all(receiver.status(f"killed-{i}") == TransferStatus.TRANSFERRING for i in range(2)))
        assert wait_for(lambda: torch_state(receiver)["pairs"] == 2)  # the dead sender's pair is gone
        for process in killed:
            process.send_signal(signal.SIGKILL)
        ok = sender.send(KVPiece("r", random_cache(layout, 4), [2, 3]), receiver.endpoint)  # one that closes cleanly
        assert ok.wait(20) == TransferStatus.DONE, ok
        owned = receiver.wait(ok.transfer_id, 5).dst_block_ids
        sender.close()
        empty = {"pairs": 0, "groups": 0, "hellos": 0, "stored_bytes": 0, "transfers": 0}
        assert wait_for(lambda: torch_state(receiver) == empty, timeout=15), torch_state(receiver)
        assert receiver.stats.bad_hellos == 1 and receiver.stats.auth_failures == 1
        assert_no_leak(pool, owned)
    finally:
        for process in killed:
            process.kill()
            process.wait()
        silent.close()
        forged.close()
        sender.close()
        receiver.close()


def test_ray_inbox_drops_acks_nobody_waits_for(make_pair, layout):
    import ray

    pair = make_pair("ray", layout)
    inbox = ray.get_actor(pair.dest[len("ray://"):])
    assert ray.get(inbox.wait_ack.remote("late", 0.01)) is None  # the sender gave up on its piece...
    ray.get(inbox.ack.remote("late", b"reply"))  # ...and its ack came after
    assert ray.get(inbox.wait_ack.remote("late", 0.01)) is None, "the late ack was kept"
    assert ray.get(inbox.num_entries.remote()) == 0
    ok = pair.sender.send(KVPiece("r", random_cache(layout, 4), [0, 1]), pair.dest)  # acks still reach live senders
    assert ok.wait(30) == TransferStatus.DONE, ok
    assert ray.get(inbox.num_entries.remote()) == 0


def test_ray_receiver_forgets_the_pieces_of_dead_senders(make_pair, layout):
    import ray

    pair = make_pair("ray", layout, receiver_options={"default_timeout_s": 0.5})
    inbox = ray.get_actor(pair.dest[len("ray://"):])
    for i in range(3):  # each sender pushes one chunk of a piece and dies before its last one
        chunk = next(encode_chunks(KVPiece("victim", random_cache(layout, 4), [0, 1], transfer_id=f"dead-{i}",
                                           layers=(0, 3)), layout, get_codec("none"),
                                   deadline_at=time.monotonic() + 60, chunk_bytes=200))
        ref = ray.put(chunk.payload.numpy())
        ray.get(inbox.push.remote(["chunk", f"piece-{i}", TOKEN, chunk.header_bytes, [ref], False]))
    assert wait_for(lambda: all(pair.receiver.status(f"dead-{i}") == TransferStatus.EXPIRED for i in range(3)))
    assert wait_for(lambda: len(pair.receiver._pieces) == 0, timeout=5), pair.receiver._pieces
    assert_no_leak(pair.pool)
