"""Receivers keep no state for senders that died: after failed, silent or killed senders, the torch
receiver's maps and its TCPStore's keys, and the ray receiver's piece state and inbox acks, return to empty."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist
from kv_helpers import TOKEN, assert_no_leak, random_cache, wait_for

from kv_transfer import SimpleBlockPool, TransferStatus, get_codec, make_receiver, make_sender
from kv_transfer.chunker import encode_chunks
from kv_transfer.transports.torch import sender as torch_sender

HELPER = os.path.join(os.path.dirname(__file__), "kv_killed_sender.py")


def torch_state(receiver) -> dict:
    """Entries the torch receiver holds, and the store keys besides the slot counter."""
    return {"pair_threads": len(receiver._pair_threads), "groups": len(receiver._groups),
            "open_slots": len(receiver._slots), "replies": len(receiver._replies),
            "transfers": receiver.num_active, "keys": sorted(set(receiver._store.list_keys()) - {"pairs"})}


def test_torch_receiver_state_and_store_keys_return_to_empty_after_dead_senders(layout, monkeypatch):
    pool = SimpleBlockPool(16)
    cache = torch.zeros(layout.cache_shape(16), dtype=layout.dtype)
    receiver = make_receiver("torch", layout, cache, pool, token=TOKEN, hello_timeout_s=0.5, default_timeout_s=3.0)
    host, _, port = receiver.endpoint.rpartition(":")
    rogue = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    killed = [subprocess.Popen([sys.executable, HELPER, "torch", receiver.endpoint, TOKEN, f"killed-{i}"],
                               stdout=subprocess.PIPE, text=True) for i in range(2)]
    sender = make_sender("torch", layout, token=TOKEN)
    try:
        rogue.add("pairs", 1)  # claims a slot, never says hello
        index = rogue.add("pairs", 1) - 1
        rogue.set(f"hello/{index}", msgpack.packb({"proof": "forged"}))  # says hello, never reads the reply

        def dies(*args, **kwargs):
            raise RuntimeError("the sender died before joining its group")

        monkeypatch.setattr(torch_sender, "make_group", dies)  # reads its reply, never joins
        dead = make_sender("torch", layout, token=TOKEN)
        assert dead.send("r", random_cache(layout, 4), [0, 1], receiver.endpoint).wait(10) == TransferStatus.FAILED
        dead.close()
        monkeypatch.undo()
        for process in killed:  # senders killed mid-transfer
            assert process.stdout.readline().strip() == "SENT"
        assert wait_for(lambda: all(receiver.status(f"killed-{i}") == TransferStatus.TRANSFERRING for i in range(2)))
        for process in killed:
            process.send_signal(signal.SIGKILL)
        ok = sender.send("r", random_cache(layout, 4), [2, 3], receiver.endpoint)  # and one that closes cleanly
        assert ok.wait(20) == TransferStatus.DONE, ok
        owned = receiver.wait(ok.transfer_id, 5).dst_block_ids
        sender.close()
        empty = {"pair_threads": 0, "groups": 0, "open_slots": 0, "replies": 0, "transfers": 0, "keys": []}
        assert wait_for(lambda: torch_state(receiver) == empty, timeout=15), torch_state(receiver)
        assert_no_leak(pool, owned)
    finally:
        for process in killed:
            process.kill()
            process.wait()
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
    ok = pair.sender.send("r", random_cache(layout, 4), [0, 1], pair.dest)  # acks still reach live senders
    assert ok.wait(30) == TransferStatus.DONE, ok
    assert ray.get(inbox.num_entries.remote()) == 0


def test_ray_receiver_forgets_the_pieces_of_dead_senders(make_pair, layout):
    import ray

    pair = make_pair("ray", layout, receiver_options={"default_timeout_s": 0.5})
    inbox = ray.get_actor(pair.dest[len("ray://"):])
    for i in range(3):  # each sender pushes one chunk of a piece and dies before its last one
        chunk = next(encode_chunks(random_cache(layout, 4), [0, 1], layout, get_codec("none"), request_id="victim",
                                   transfer_id=f"dead-{i}", layers=(0, 3), deadline_at=time.monotonic() + 60,
                                   chunk_bytes=200))
        ref = ray.put(chunk.payload.numpy())
        ray.get(inbox.push.remote(["chunk", f"piece-{i}", TOKEN, chunk.header_bytes, [ref], False]))
    assert wait_for(lambda: all(pair.receiver.status(f"dead-{i}") == TransferStatus.EXPIRED for i in range(3)))
    assert wait_for(lambda: len(pair.receiver._pieces) == 0, timeout=5), pair.receiver._pieces
    assert_no_leak(pair.pool)
