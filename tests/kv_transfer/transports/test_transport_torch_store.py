"""A torch pair's rendezvous key space: exact bounds, a breach or close fails every call (blocked ones too),
blocking calls keep to their timeout, and the Store over the connection answers as the one in process."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from kv_transfer.transports.tcp.protocol import send_small
from kv_transfer.transports.torch.pair import make_group
from kv_transfer.transports.torch.store import (
    MAX_KEYS,
    MAX_SPACE_BYTES,
    MAX_VALUE_BYTES,
    KeySpace,
    PairStore,
    RemoteSpace,
    serve_store,
)
from kv_transfer.wire import WireError

TIMEOUT = timedelta(seconds=5)


@pytest.fixture
def remote():
    """(the served KeySpace, a PairStore over the connection to it, the serving thread)."""
    space, (server, client) = KeySpace(), socket.socketpair()
    thread = threading.Thread(target=_serve, args=(server, space), daemon=True)
    thread.start()
    store = PairStore(RemoteSpace(client), TIMEOUT)
    yield space, store, thread
    store.space.close()
    thread.join(5)


def _serve(conn, space) -> None:
    try:
        serve_store(conn, space)
    finally:
        conn.close()


def test_exactly_max_keys_fit_and_one_more_breaks_the_space():
    space = KeySpace()
    for i in range(MAX_KEYS):
        space.set(f"k{i}", b"v")
    space.set("k0", b"again")                                   # an overwrite adds no key
    assert space.num_keys() == MAX_KEYS and space.nbytes == sum(len(f"k{i}") + 1 for i in range(MAX_KEYS)) + 4
    with pytest.raises(dist.DistStoreError, match=f"over its bound: more than {MAX_KEYS} keys"):
        space.set("one-more", b"v")
    assert space.closed and space.nbytes == 0
    with pytest.raises(dist.DistStoreError, match="more than 64 keys"):  # every later call says why
        space.check(["k1"])


@pytest.mark.parametrize("writes, why", [
    ([("big", b"x" * (MAX_VALUE_BYTES + 1))], f"a value of {MAX_VALUE_BYTES + 1} bytes"),
    ([(f"k{i}", b"x" * MAX_VALUE_BYTES) for i in range(4)], f"more than {MAX_SPACE_BYTES} bytes in all"),
    ([("k" * 513, b"")], "a key of 513 bytes"),
])
def test_a_value_a_key_or_the_total_over_its_bound_breaks_the_space(writes, why):
    space = KeySpace()
    with pytest.raises(dist.DistStoreError, match=why):
        for key, value in writes:
            space.set(key, value)
    assert space.closed and space.nbytes == 0


def test_blocking_calls_keep_to_their_timeout_and_close_wakes_them():
    space = KeySpace()
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="not set within 0.2 s"):
        space.get("missing", 0.2)
    assert 0.15 < time.monotonic() - start < 2
    errors: list[str] = []

    def blocked() -> None:
        try:
            space.wait(["never"], 60)
        except dist.DistStoreError as exc:
            errors.append(str(exc))

    waiter = threading.Thread(target=blocked)
    waiter.start()
    space.close("the pair ended")
    waiter.join(5)
    assert not waiter.is_alive() and errors == ["the pair ended"]


def test_add_and_compare_set_follow_c10d():
    space = KeySpace()
    assert space.add("n", 2) == 2 and space.add("n", 3) == 5 and space.get("n", 0) == b"5"
    assert space.compare_set("c", b"", b"first") == b"first"     # absent and expected empty: set
    assert space.compare_set("c", b"other", b"x") == b"first"     # differs: stays
    assert space.compare_set("c", b"first", b"second") == b"second"
    assert space.compare_set("absent", b"e", b"d") == b"e" and not space.check(["absent"])


def test_the_store_over_the_connection_answers_as_the_space(remote):
    space, store, _ = remote
    store.set("a", "1")
    store.multi_set(["b", "c"], [b"2", b"3"])
    assert store.get("a") == b"1" and store.multi_get(["b", "c"]) == [b"2", b"3"]
    assert store.add("n", 4) == 4 and store.add("n", 1) == 5
    store.append("a", b"+")
    assert store.compare_set("a", b"1+", b"z") == b"z" and space.get("a", 0) == b"z"
    assert store.check(["a", "b"]) and not store.check(["a", "missing"])
    assert store.delete_key("b") and not store.delete_key("b")
    assert store.num_keys() == 3 and sorted(store.list_keys()) == ["a", "c", "n"]
    store.wait(["a", "c"], timedelta(seconds=1))
    with pytest.raises(dist.DistStoreError, match="not set within"):
        store.wait(["missing"], timedelta(seconds=0.2))
    assert store.clone() is store and store.has_extended_api()
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError):
        store.get("missing")                                     # the store's own timeout, not a day


def test_a_value_over_its_bound_is_neither_sent_nor_read(remote):
    _, store, thread = remote
    with pytest.raises(dist.DistStoreError, match=f"over its bound: a value of {MAX_VALUE_BYTES + 1} bytes"):
        store.set("big", b"x" * (MAX_VALUE_BYTES + 1))
    thread.join(5)
    assert not thread.is_alive()                                 # the sender closed: the pair's set-up ends
    server, client = socket.socketpair()                         # a sender that announces one anyway
    with server, client:
        send_small(client, {"op": "set", "key": "big", "n": 0, "timeout_ms": 0, "len": MAX_VALUE_BYTES + 1,
                            "len2": 0})
        with pytest.raises(WireError, match="over its bound"):   # before a byte of it is read
            serve_store(server, KeySpace())


def test_a_gloo_pair_builds_over_the_two_stores(remote):
    space, remote_store, _ = remote
    groups = [None, None]

    def build(rank, store):
        groups[rank] = make_group(store, rank, "gloo", TIMEOUT, "127.0.0.1", None)

    builders = [threading.Thread(target=build, args=(0, remote_store)),
                threading.Thread(target=build, args=(1, PairStore(space, TIMEOUT)))]
    for thread in builders:
        thread.start()
    for thread in builders:
        thread.join(10)
    sent, received = torch.arange(6, dtype=torch.float32), torch.zeros(6)
    work = groups[0].send([sent], 1, 0)
    assert groups[1].recv([received], 0, 0).wait(TIMEOUT) and work.wait(TIMEOUT)
    assert torch.equal(received, sent)
    assert space.nbytes < 1024                                    # two addresses, far below the bound
