"""torch rendezvous, authenticated both ways: a peer without the secret stores nothing and keeps no sender
out (forged, junk, silent or slow hellos), a wrong token or a replayed hello is refused, a sender builds no
group on a reply the receiver did not make for its hello, no message holds the token, and a pair's key space
is bounded and gone once the pair ends."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import socket
import threading
import time

import pytest
import torch
from kv_helpers import TOKEN, assert_no_leak, random_cache, wait_for

from kv_transfer import FailedSide, KVPiece, SimpleBlockPool, TransferStatus, make_receiver, make_sender
from kv_transfer.transports.tcp.protocol import NONCE_BYTES, recv_exact, recv_small, send_small
from kv_transfer.transports.torch import receiver as torch_receiver
from kv_transfer.transports.torch import rendezvous
from kv_transfer.transports.torch import sender as torch_sender
from kv_transfer.transports.torch.store import MAX_KEYS, MAX_VALUE_BYTES, KeySpace


@pytest.fixture
def new_receiver(layout):
    made = []

    def factory(**kwargs):
        pool = SimpleBlockPool(16)
        receiver = make_receiver("torch", layout, torch.zeros(layout.cache_shape(16), dtype=layout.dtype), pool,
                                 token=TOKEN, **kwargs)
        made.append(receiver)
        return receiver, pool

    yield factory
    for receiver in made:
        receiver.close()


@pytest.fixture
def written(monkeypatch):
    """Every (key, value) any pair's key space took, in order."""
    log: list[tuple[str, bytes]] = []
    real = KeySpace._put

    def recording(space, key, value):
        log.append((key, value))
        return real(space, key, value)

    monkeypatch.setattr(KeySpace, "_put", recording)
    return log


@pytest.fixture
def hellos(monkeypatch):
    """Every rendezvous message a sender sent."""
    sent: list[dict] = []
    real = rendezvous.send_small

    def recording(sock, message):
        sent.append(message)
        return real(sock, message)

    monkeypatch.setattr(rendezvous, "send_small", recording)
    return sent


def connect(receiver) -> socket.socket:
    """A raw connection to the receiver that has read its challenge."""
    host, _, port = receiver.endpoint.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=10)
    assert len(recv_exact(conn, NONCE_BYTES)) == NONCE_BYTES
    return conn


def closed_by_peer(conn: socket.socket) -> bool:
    """Read (and drop) what the peer sends until it closes: True, or False when it stays open 10 s."""
    try:
        while conn.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except ConnectionError:  # reset: closed too
        pass
    return True


def exact_transfer(sender, receiver, pool, layout, seed: int = 0) -> None:
    """A transfer that lands bit for bit; its blocks go back to the pool after."""
    src, block_ids = random_cache(layout, 4, seed=seed), [3, 0, 2]
    handle = sender.send(KVPiece("r", src, block_ids, deadline_s=10), receiver.endpoint)
    assert handle.wait(15) == TransferStatus.DONE, handle
    result = receiver.wait(handle.transfer_id, 5)
    received = receiver.kv_cache[:, result.dst_block_ids]
    assert torch.equal(received.view(torch.uint8), src[:, block_ids].view(torch.uint8))
    assert_no_leak(pool, result.dst_block_ids)
    pool.free(result.dst_block_ids)


def rendezvous_state(receiver) -> dict:
    return {"pairs": len(receiver._pairs), "hellos": len(receiver._slots), "groups": receiver.num_groups}


EMPTY = {"pairs": 0, "hellos": 0, "groups": 0}


def secret_forms(token: str) -> list[bytes]:
    """The token and what it follows from trivially: encodings, an unsalted hash, the key derived from it."""
    raw = token.encode()
    derived = hmac.new(raw, rendezvous.RENDEZVOUS_CONTEXT, hashlib.sha256).digest()
    forms = [raw, raw.hex().encode(), base64.b64encode(raw), hashlib.sha256(raw).digest(), derived]
    return forms + [hashlib.sha256(raw).hexdigest().encode(), derived.hex().encode()]


def test_no_message_or_stored_value_holds_the_token(layout, new_receiver, written, hellos):
    receiver, pool = new_receiver()
    sender = make_sender("torch", layout, token=TOKEN)
    try:
        exact_transfer(sender, receiver, pool, layout)
        assert written and hellos                          # the rendezvous and the group's keys went through
        for value in [value for _, value in written] + [repr(message).encode() for message in hellos]:
            for form in secret_forms(TOKEN):
                assert form not in value, f"{value[:80]!r} holds the token (as {form!r})"
    finally:
        sender.close()


@pytest.mark.parametrize("hello", [
    {"op": "set", "key": "reply/0", "n": 0, "timeout_ms": 0, "len": 4, "len2": 0},   # store calls, no hello
    {"nonce": "aa", "layout": {}, "backend": "gloo"},                                # no proof
    {"nonce": "aa", "proof": "00" * 32, "layout": {}, "backend": "gloo"},            # a forged proof
])
def test_a_forger_without_the_secret_stores_nothing(layout, new_receiver, written, hello):
    receiver, pool = new_receiver()
    sender = make_sender("torch", layout, token=TOKEN)
    forger = connect(receiver)
    try:
        with contextlib.suppress(OSError):                    # (the receiver may have closed already)
            send_small(forger, hello)
            forger.sendall(b"junk")
            for key in ("reply/0", "challenge/0", "hello/0"):  # then tries to write what senders read
                send_small(forger, {"op": "set", "key": key, "n": 0, "timeout_ms": 0, "len": 1, "len2": 0})
        assert closed_by_peer(forger)                         # answered (refused) at most, then closed
        assert wait_for(lambda: receiver.stats.auth_failures + receiver.stats.bad_hellos == 1, timeout=5)
        assert written == [] and rendezvous_state(receiver) == EMPTY
        exact_transfer(sender, receiver, pool, layout)        # a new pair still sets up and lands exact bytes
        assert written and not any(key.startswith(("reply/", "challenge/", "hello/")) for key, _ in written)
    finally:
        forger.close()
        sender.close()


def test_a_wrong_token_is_refused_and_a_replayed_hello_too(layout, new_receiver, hellos):
    receiver, pool = new_receiver()
    wrong = make_sender("torch", layout, token="not-the-token", connect_timeout_s=5)
    sender = make_sender("torch", layout, token=TOKEN)
    try:
        refused = wrong.send(KVPiece("r", random_cache(layout, 4), [0, 1]), receiver.endpoint)
        assert refused.wait(15) == TransferStatus.FAILED, refused
        assert refused.failed_side == FailedSide.RECEIVER and refused.error == "receiver rejected the cluster token"
        assert receiver.stats.auth_failures == 1 and wrong.num_groups == 0
        exact_transfer(sender, receiver, pool, layout)
        replay = connect(receiver)                            # an eavesdropper replays the genuine hello
        send_small(replay, hellos[-1])
        reply = recv_small(replay)
        assert not reply["ok"] and reply["error"] == "receiver rejected the cluster token", reply
        assert closed_by_peer(replay) and receiver.stats.auth_failures == 2
        replay.close()
    finally:
        wrong.close()
        sender.close()
    assert wait_for(lambda: rendezvous_state(receiver) == EMPTY, timeout=5), rendezvous_state(receiver)


class _FakeReceiver:
    """A listener that speaks the rendezvous but answers every hello with ``reply(server_nonce, hello)``."""

    def __init__(self, reply) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.reply, self.num_hellos = reply, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                nonce = b"n" * NONCE_BYTES
                conn.sendall(nonce)
                hello = recv_small(conn)
                self.num_hellos += 1
                send_small(conn, self.reply(nonce, hello))
                closed_by_peer(conn)


@pytest.mark.parametrize("case", ["no mac", "a mac under another key", "a mac for another hello"])
def test_a_sender_builds_no_group_on_a_reply_the_receiver_did_not_make(layout, case):
    key = rendezvous.rendezvous_key(TOKEN)

    def forged(nonce: bytes, hello: dict) -> dict:
        reply = {"ok": True, "error": "", "layout": layout.describe("none"), "index": 0}
        if case == "a mac under another key":
            reply["mac"] = rendezvous.reply_mac(rendezvous.rendezvous_key("other"), nonce, hello["nonce"], reply)
        elif case == "a mac for another hello":  # a genuine reply, replayed to a later hello
            reply["mac"] = rendezvous.reply_mac(key, nonce, "an-earlier-nonce", reply)
        return reply

    fake = _FakeReceiver(forged)
    sender = make_sender("torch", layout, token=TOKEN, connect_timeout_s=5)
    try:
        handle = sender.send(KVPiece("r", random_cache(layout, 4), [0, 1], deadline_s=5), fake.endpoint)
        assert handle.wait(10) == TransferStatus.FAILED and handle.failed_side == FailedSide.TRANSPORT, handle
        assert "not authenticated" in handle.error and fake.num_hellos == 1 and sender.num_groups == 0
    finally:
        sender.close()
        fake.listener.close()


def test_silent_peers_beyond_the_hello_slots_keep_no_sender_out(layout, new_receiver, monkeypatch):
    monkeypatch.setattr(torch_receiver, "MAX_HELLOS", 4)
    receiver, pool = new_receiver(hello_timeout_s=60.0)      # silent peers would hold a slot for a minute
    sender, later = make_sender("torch", layout, token=TOKEN), make_sender("torch", layout, token=TOKEN)
    silent = [connect(receiver) for _ in range(12)]
    try:
        assert wait_for(lambda: len(receiver._slots) == 4 and receiver.stats.bad_hellos == 8)
        exact_transfer(sender, receiver, pool, layout)
        silent += [connect(receiver) for _ in range(12)]     # more after the first sender paired
        exact_transfer(later, receiver, pool, layout, seed=1)
        exact_transfer(sender, receiver, pool, layout, seed=2)   # the first pair never held a hello slot
        assert receiver.num_groups == 2 and receiver.stats.auth_failures == 0
    finally:
        for conn in silent:
            conn.close()
        sender.close()
        later.close()


def test_a_slow_drip_hello_is_dropped_at_one_deadline(new_receiver):
    receiver, _ = new_receiver(hello_timeout_s=0.6)
    conn = connect(receiver)
    started, dropped = time.monotonic(), False
    try:
        conn.sendall((100).to_bytes(4, "little"))          # a 100-byte hello ...
        for _ in range(60):                                 # ... a byte each 0.1 s: no single read waits long
            try:
                conn.sendall(b"\x81")
            except OSError:
                dropped = True
                break
            if wait_for(lambda: len(receiver._slots) == 0, timeout=0.1):
                dropped = True
                break
        assert dropped and time.monotonic() - started < 4  # near 0.6 s, not 100 reads later
        assert wait_for(lambda: receiver.stats.bad_hellos == 1, timeout=2)
    finally:
        conn.close()


def test_junk_hellos_are_counted_and_one_warning_never_a_traceback(layout, new_receiver, caplog):
    receiver, pool = new_receiver()
    caplog.set_level(logging.WARNING)
    sender = make_sender("torch", layout, token=TOKEN)
    try:
        framed = [len(junk).to_bytes(4, "little") + junk for junk in (b"\xc1\xc1\xc1", b"\x92\x01", b"\xff" * 8)]
        for frame in framed + [(1 << 20).to_bytes(4, "little")]:  # not msgpack, not a map, junk, a 1 MiB hello
            conn = connect(receiver)
            conn.sendall(frame)
            assert closed_by_peer(conn)
            conn.close()
        assert wait_for(lambda: receiver.stats.bad_hellos == 4, timeout=5)
        exact_transfer(sender, receiver, pool, layout)
    finally:
        sender.close()
    mine = [record for record in caplog.records if record.name.startswith("kv_transfer")]
    assert [record.levelno for record in mine] == [logging.WARNING] and not any(r.exc_info for r in mine), mine
    assert "before it authenticated" in mine[0].getMessage()


@pytest.mark.parametrize("writes, why", [
    ([(f"junk/{i}", b"x") for i in range(MAX_KEYS + 1)], f"more than {MAX_KEYS} keys"),
    ([("junk", b"x" * (MAX_VALUE_BYTES + 1))], f"a value of {MAX_VALUE_BYTES + 1} bytes"),
])
def test_a_pair_over_its_store_bounds_fails_clearly_and_leaves_nothing(layout, new_receiver, monkeypatch, writes,
                                                                      why):
    receiver, pool = new_receiver()
    real = torch_sender.make_group

    def greedy(store, *args):  # an authenticated sender that stores more than a pair needs
        for key, value in writes:
            store.set(key, value)
        return real(store, *args)

    monkeypatch.setattr(torch_sender, "make_group", greedy)
    sender = make_sender("torch", layout, token=TOKEN)
    try:
        handle = sender.send(KVPiece("r", random_cache(layout, 4), [0, 1], deadline_s=10), receiver.endpoint)
        assert handle.wait(15) == TransferStatus.FAILED and handle.failed_side == FailedSide.TRANSPORT, handle
        assert f"store over its bound: {why}" in handle.error, handle.error
        assert wait_for(lambda: rendezvous_state(receiver) == EMPTY, timeout=5), rendezvous_state(receiver)
        monkeypatch.undo()
        exact_transfer(sender, receiver, pool, layout)
    finally:
        sender.close()
    assert wait_for(lambda: rendezvous_state(receiver) == EMPTY, timeout=5), rendezvous_state(receiver)
