"""torch rendezvous over the decode side's TCPStore: no secret is ever stored, a slot claimed by a client
that never says hello wedges nobody, and a wrong or replayed proof is refused."""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import timedelta

import msgpack
import pytest
import torch
import torch.distributed as dist
from kv_helpers import TOKEN, assert_no_leak, random_cache

from kv_transfer import FailedSide, SimpleBlockPool, TransferStatus, make_receiver, make_sender


@pytest.fixture
def store_writes(monkeypatch):
    """Every (key, value) written through a TCPStore from Python, by the sender and by the receiver."""
    written: list[tuple[str, bytes]] = []
    real_set = dist.TCPStore.set

    def recording_set(store, key, value):
        written.append((key, value.encode() if isinstance(value, str) else bytes(value)))
        return real_set(store, key, value)

    monkeypatch.setattr(dist.TCPStore, "set", recording_set)
    return written


@pytest.fixture
def torch_receiver(layout):
    pool = SimpleBlockPool(16)
    receiver = make_receiver("torch", layout, torch.zeros(layout.cache_shape(16), dtype=layout.dtype), pool,
                             token=TOKEN)
    yield receiver, pool
    receiver.close()


def store_client(endpoint: str) -> dist.TCPStore:
    host, _, port = endpoint.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))


def secret_forms(token: str) -> list[bytes]:
    """The token and what it follows from trivially: encodings, an unsalted hash, a key derived from it."""
    raw = token.encode()
    derived = hmac.new(raw, b"pdserve-kv-rendezvous-v1", hashlib.sha256).digest()
    forms = [raw, raw.hex().encode(), base64.b64encode(raw), hashlib.sha256(raw).digest(), derived]
    return forms + [hashlib.sha256(raw).hexdigest().encode(), derived.hex().encode()]


def test_no_store_value_holds_the_token(layout, torch_receiver, store_writes):
    receiver, pool = torch_receiver
    sender = make_sender("torch", layout, token=TOKEN)
    try:
        handle = sender.send("r", random_cache(layout, 4), [0, 1], receiver.endpoint)
        assert handle.wait(20) == TransferStatus.DONE, handle
        assert any(key.startswith("hello/") for key, _ in store_writes)  # the rendezvous went through the store
        left = [(key, receiver._store.get(key)) for key in receiver._store.list_keys()]
        for key, value in store_writes + left:
            for form in secret_forms(TOKEN):
                assert form not in value, f"store key {key!r} holds the token (as {form!r})"
    finally:
        sender.close()


def test_a_slot_claimed_without_hello_does_not_wedge_the_accept_loop(layout, torch_receiver):
    """A client that takes a pair index and goes silent (a sender killed between its two store
    calls) must not stop a later genuine sender from pairing."""
    receiver, pool = torch_receiver
    rogue = store_client(receiver.endpoint)
    rogue.add("pairs", 1)
    sender = make_sender("torch", layout, token=TOKEN, connect_timeout_s=5)
    try:
        handle = sender.send("r", random_cache(layout, 4), [0, 1], receiver.endpoint, deadline_s=10)
        assert handle.wait(15) == TransferStatus.DONE, handle
        assert receiver.wait(handle.transfer_id, 5).status == TransferStatus.DONE
        rogue.add("pairs", 1)  # a second silent claim, after a pair is up: the next sender still pairs
        again = make_sender("torch", layout, token=TOKEN, connect_timeout_s=5)
        try:
            handle = again.send("r2", random_cache(layout, 4), [2, 3], receiver.endpoint, deadline_s=10)
            assert handle.wait(15) == TransferStatus.DONE, handle
        finally:
            again.close()
    finally:
        sender.close()


def test_a_wrong_or_replayed_proof_is_refused(layout, torch_receiver, store_writes):
    receiver, pool = torch_receiver
    wrong = make_sender("torch", layout, token="not-the-token", connect_timeout_s=5)
    sender = make_sender("torch", layout, token=TOKEN)
    try:
        refused = wrong.send("r", random_cache(layout, 4), [0, 1], receiver.endpoint)
        assert refused.wait(15) == TransferStatus.FAILED, refused
        assert refused.failed_side == FailedSide.RECEIVER and "token" in refused.error
        assert receiver.stats.auth_failures == 1
        handle = sender.send("r", random_cache(layout, 4), [0, 1], receiver.endpoint)
        assert handle.wait(20) == TransferStatus.DONE, handle
        # An eavesdropper that read the genuine hello replays it on a slot of its own.
        genuine_hello = [value for key, value in store_writes if key.startswith("hello/")][-1]
        rogue = store_client(receiver.endpoint)
        index = rogue.add("pairs", 1) - 1
        rogue.set(f"hello/{index}", genuine_hello)
        rogue.wait([f"reply/{index}"], timedelta(seconds=10))
        reply = msgpack.unpackb(rogue.get(f"reply/{index}"), raw=False)
        assert not reply["ok"] and "token" in reply["error"], reply
        assert receiver.stats.auth_failures == 2
        assert_no_leak(pool, receiver.wait(handle.transfer_id, 5).dst_block_ids)
    finally:
        wrong.close()
        sender.close()
