"""torch transport: lazy pairwise groups, LRU bound, teardown when a peer dies, NCCL's in-order semantics."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch
from kv_helpers import TOKEN, assert_no_leak, random_cache

from kv_transfer import FailedSide, KVPiece, SimpleBlockPool, TransferStatus, make_receiver, make_sender


def receiver(layout, pool):
    cache = torch.zeros(layout.cache_shape(pool.num_blocks), dtype=layout.dtype)
    return make_receiver("torch", layout, cache, pool, token=TOKEN), cache


def test_groups_are_lazy_bounded_and_evicted_lru(layout):
    pools = [SimpleBlockPool(8) for _ in range(3)]
    receivers = [receiver(layout, pool)[0] for pool in pools]
    sender = make_sender("torch", layout, token=TOKEN, max_groups=2)
    try:
        assert sender.num_groups == 0  # nothing until the first send
        src = random_cache(layout, 4)
        for r in receivers + receivers[:1]:
            handle = sender.send(KVPiece("r", src, [1, 2]), r.endpoint)
            assert handle.wait(20) == TransferStatus.DONE, handle
        assert sender.num_groups == 2
        assert list(sender._pairs) == [receivers[2].endpoint, receivers[0].endpoint]  # receiver 1 was evicted
        assert [p.num_used for p in pools] == [4, 2, 2]
    finally:
        sender.close()
        for r in receivers:
            r.close()


def test_unreachable_receiver_is_a_transport_failure(layout):
    sender = make_sender("torch", layout, token=TOKEN, connect_timeout_s=1)
    try:
        handle = sender.send(KVPiece("r", random_cache(layout, 2), [0]), "127.0.0.1:1")  # nobody listens there
        assert handle.wait(30) == TransferStatus.FAILED and handle.failed_side == FailedSide.TRANSPORT, handle
        assert sender.num_groups == 0
    finally:
        sender.close()


def test_receiver_process_death_fails_the_send_and_drops_the_group(layout, tmp_path):
    script = tmp_path / "recv.py"
    script.write_text(
        "import os, sys, time, torch\n"
        f"sys.path.insert(0, {str(__import__('pathlib').Path(__file__).resolve().parents[3])!r})\n"
        "os.environ['GLOO_SOCKET_IFNAME'] = 'lo'\n"
        "from kv_transfer import KVLayout, SimpleBlockPool, make_receiver\n"
        "layout = KVLayout(3, 2, 4, 8, torch.float32, 'tiny-test')\n"
        "pool = SimpleBlockPool(8)\n"
        f"r = make_receiver('torch', layout, torch.zeros(layout.cache_shape(8)), pool, token={TOKEN!r})\n"
        "print(r.endpoint, flush=True)\n"
        "time.sleep(600)\n"
    )
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    sender = make_sender("torch", layout, token=TOKEN)
    try:
        endpoint = process.stdout.readline().strip()
        src = random_cache(layout, 4)
        assert sender.send(KVPiece("r", src, [0, 1]), endpoint).wait(30) == TransferStatus.DONE
        process.kill()
        process.wait()
        handle = sender.send(KVPiece("r", src, [0, 1]), endpoint)
        assert handle.wait(30) == TransferStatus.FAILED and handle.failed_side == FailedSide.TRANSPORT, handle
        assert sender.num_groups == 0
    finally:
        process.kill()
        sender.close()


class _InOrderGroup:
    """NCCL's ordering on top of gloo: each side's sends and receives on a pair run one at a
    time, in the order they were posted. A protocol that posts a receive ahead of a send the
    peer is waiting for deadlocks here, as it would on NCCL."""

    def __init__(self, group) -> None:
        self.group, self.ops = group, queue.Queue()
        threading.Thread(target=self._issue, daemon=True).start()   # a deadlocked test must not hang exit

    def _issue(self) -> None:
        while True:
            op, tensors, peer, tag, done = self.ops.get()
            try:
                getattr(self.group, op)(tensors, peer, tag).wait()
                done.set_result(None)
            except Exception as exc:
                done.set_exception(exc)

    def _post(self, op, tensors, peer, tag):
        done = Future()
        self.ops.put((op, tensors, peer, tag, done))
        return _Work(done)

    def send(self, tensors, peer, tag):
        return self._post("send", tensors, peer, tag)

    def recv(self, tensors, peer, tag):
        return self._post("recv", tensors, peer, tag)


class _Work:
    def __init__(self, done: Future) -> None:
        self.done = done

    def wait(self, timeout=None) -> bool:
        try:
            self.done.result(None if timeout is None else timeout.total_seconds())
        except FutureTimeout:
            return False
        return True


def test_the_pair_protocol_keeps_nccl_order(layout, monkeypatch):
    """Announced payloads, the ack, an abort with its filler and a close all complete when every
    operation runs in posting order (NCCL) — checked on gloo with that order imposed."""
    from kv_transfer.transports.torch import receiver as torch_receiver
    from kv_transfer.transports.torch import sender as torch_sender

    for module in (torch_sender, torch_receiver):
        real = module.make_group
        monkeypatch.setattr(module, "make_group", lambda *args, real=real: _InOrderGroup(real(*args)))
    pool = SimpleBlockPool(16)
    dst = torch.zeros(layout.cache_shape(16), dtype=layout.dtype)
    receiver = make_receiver("torch", layout, dst, pool, codec="fp8", token=TOKEN)
    sender = make_sender("torch", layout, codec="fp8", token=TOKEN, chunk_bytes=200)
    try:
        src = random_cache(layout, 4)
        first = sender.send(KVPiece("a", src, [0, 1, 2, 3], deadline_s=10), receiver.endpoint)
        assert first.wait(15) == TransferStatus.DONE, first              # many chunks, each announced ahead
        bad = src.clone()
        bad[2, 3, 1, 0, 0, 0] = float("nan")                            # fails mid-piece: abort + filler
        aborted = sender.send(KVPiece("b", bad, [0, 1, 2, 3], deadline_s=10), receiver.endpoint)
        assert aborted.wait(15) == TransferStatus.FAILED and "NaN" in aborted.error
        again = sender.send(KVPiece("c", src, [2, 3], deadline_s=10), receiver.endpoint)
        assert again.wait(15) == TransferStatus.DONE, again             # the pair is still in step
        done = [receiver.wait(h.transfer_id, 5) for h in (first, again)]
        assert all(r.status == TransferStatus.DONE for r in done)
        assert_no_leak(pool, [b for r in done for b in r.dst_block_ids])
    finally:
        sender.close()                                                  # close message in order too
        receiver.close()
