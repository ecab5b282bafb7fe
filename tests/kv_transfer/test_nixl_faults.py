"""The nixl transport's faults between two processes: a receiver killed mid-transfer, a sender killed after
its registration, a READ stalled past the deadline. Each ends with its status and no block held on either
side. This file is also the peer process: ``python test_nixl_faults.py receive|send-part|stall ...``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
if __name__ == "__main__":
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402
from kv_helpers import TOKEN, assert_no_leak, random_cache, wait_for  # noqa: E402

from kv_transfer import (  # noqa: E402
    FailedSide,
    KVLayout,
    KVPiece,
    SimpleBlockPool,
    TransferStatus,
    make_receiver,
    make_sender,
)
from kv_transfer.transports.nixl.agent import available  # noqa: E402

UNAVAILABLE = available()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"nixl cannot be imported: {UNAVAILABLE}")


def _layout() -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32,
                    model_fingerprint="tiny-test")


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, HERE, *args], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _line(process: subprocess.Popen) -> str:
    return process.stdout.readline().strip()


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(10)


def test_receiver_killed_mid_transfer_fails_the_send_at_once(layout):
    receiver = _spawn("receive", "pull", "fp8")
    sender = make_sender("nixl", layout, codec="fp8", token=TOKEN, chunk_bytes=200)
    try:
        ready = _line(receiver)
        assert ready.startswith("READY "), ready
        dest = ready.split()[1]
        src = random_cache(layout, 5)
        first = sender.send(KVPiece("r", src, [0, 1, 2], transfer_id="t", layers=(0, 1)), dest)
        assert first.wait(30) == TransferStatus.DONE, first
        receiver.send_signal(signal.SIGSTOP)            # the next piece's chunks wait in its socket
        second = sender.send(KVPiece("r", src, [0, 1, 2], transfer_id="t", layers=(1, 3), deadline_s=120), dest)
        assert wait_for(lambda: second.status == TransferStatus.TRANSFERRING, 10)
        started = time.monotonic()
        receiver.send_signal(signal.SIGKILL)
        assert second.wait(30) == TransferStatus.FAILED and second.failed_side == FailedSide.TRANSPORT, second
        assert time.monotonic() - started < 10         # the broken connection, not the 120 s deadline
        assert sender.staging.num_used == 0            # nothing of the prefill side stays taken
    finally:
        sender.close()
        _stop(receiver)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_sender_killed_after_registration_frees_the_blocks(layout, mode):
    pool = SimpleBlockPool(16)
    dst = torch.zeros(layout.cache_shape(16))
    receiver = make_receiver("nixl", layout, dst, pool, codec="none", token=TOKEN, mode=mode)
    process = _spawn("send-part", receiver.endpoint, mode)
    try:
        assert _line(process) == "SENT"
        assert receiver.status("killed") == TransferStatus.TRANSFERRING and pool.num_used == 3
        process.send_signal(signal.SIGKILL)
        result = receiver.wait("killed", 10)          # its deadline is 120 s: this is the broken connection
        assert result.status == TransferStatus.FAILED and result.request_id == "victim"
        assert wait_for(lambda: pool.num_used == 0 and receiver.num_in_flight == 0, 10)
        assert_no_leak(pool)
    finally:
        _stop(process)
        receiver.close()


def test_a_stalled_read_expires_and_both_sides_free_their_blocks(layout):
    """UCX over TCP serves a READ from the sender's process: stopped there, the READ stalls. The receiver
    reports EXPIRED at the deadline and holds the blocks back (a late READ could still fill them) until the
    READ ends; the sender's lease ends at its deadline too."""
    pool = SimpleBlockPool(16)
    dst = torch.zeros(layout.cache_shape(16))
    receiver = make_receiver("nixl", layout, dst, pool, codec="none", token=TOKEN, ucx_tls="tcp")
    process = _spawn("stall", receiver.endpoint)
    try:
        assert _line(process) == "READY"
        assert wait_for(lambda: process.poll() is None and _state(process.pid) == "T", 20)   # stopped itself
        result = receiver.wait("stalled", 10)
        assert result.status == TransferStatus.EXPIRED and "deadline" in result.error
        assert receiver.num_in_flight == 1 and receiver.held.num_deferred == 3 and pool.num_used == 3
        process.send_signal(signal.SIGCONT)             # the READ is served late: nothing of it is used
        assert _line(process) == "EXPIRED 0"           # the sender's handle, and its staging slots in use
        assert wait_for(lambda: pool.num_used == 0 and receiver.num_in_flight == 0, 10)
        assert_no_leak(pool)
        assert not bool(dst[:, 3:].any())              # the late bytes landed only in the blocks held back
    finally:
        _stop(process)
        receiver.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


# --- the peer process --------------------------------------------------------------------------
def _receive(mode: str, codec: str) -> None:
    layout = _layout()
    pool = SimpleBlockPool(16)
    receiver = make_receiver("nixl", layout, torch.zeros(layout.cache_shape(16)), pool, codec=codec,
                             token=TOKEN, mode=mode)
    print(f"READY {receiver.endpoint}", flush=True)
    sys.stdin.read()


def _send_part(dest: str, mode: str) -> None:
    layout = _layout()
    sender = make_sender("nixl", layout, token=TOKEN, mode=mode)
    cache = torch.randn(layout.cache_shape(4))
    piece = KVPiece("victim", cache, [0, 1, 2], transfer_id="killed", layers=(0, 1), deadline_s=120)
    if sender.send(piece, dest).wait(30) != TransferStatus.DONE:
        raise SystemExit("the first piece failed")
    print("SENT", flush=True)
    threading.Event().wait()  # registered, connected, one piece landed: until killed


def _stall(dest: str) -> None:
    """Stop this process right after a chunk's descriptors went out, before the receiver's READ is served."""
    from kv_transfer.transports.nixl import sender as nixl_sender

    layout = _layout()
    sender = make_sender("nixl", layout, token=TOKEN, ucx_tls="tcp")
    cache = torch.randn(layout.cache_shape(4))
    sender.handshake(dest)
    real = nixl_sender._Link.send

    def send_then_stop(link, message):
        real(link, message)
        if message.get("kind") == "chunk":  # this thread takes the stop before it can send anything more
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    nixl_sender._Link.send = send_then_stop
    print("READY", flush=True)
    handle = sender.send(KVPiece("victim", cache, [0, 1, 2], transfer_id="stalled", deadline_s=2.0), dest)
    handle.wait(60)
    staged = sender.staging.num_used if sender.staging is not None else 0
    print(f"{handle.status.name} {staged}", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    {"receive": _receive, "send-part": _send_part, "stall": _stall}[role](*rest)
