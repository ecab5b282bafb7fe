"""The rendezvous key space of one torch pair, and the torch.distributed Store over it.

    KeySpace     one pair's keys (a dict and a Condition), bounded: MAX_KEYS keys, MAX_VALUE_BYTES a value,
                 MAX_SPACE_BYTES in all. A write over a bound breaks the space; a broken or closed space
                 fails every call, the blocked ones too, so the pair's set-up fails with the reason
    RemoteSpace  the same calls, made by the sender over the pair's rendezvous connection, one at a time
    PairStore    the ``dist.Store`` a pair's group is built over, on either: the receiver's rank over the
                 KeySpace in process, the sender's over a RemoteSpace
    serve_store  the receiver's end of the connection: answers each call from the KeySpace

Each pair has a key space of its own, so no key needs a prefix (``dist.PrefixStore`` cannot wrap a Store
written in Python). On the connection a call is a small msgpack map (``tcp.protocol.send_small``: u32 length |
msgpack) {op, key, n, timeout_ms, len, len2} followed by ``len`` (compare_set: then ``len2``) raw value bytes;
its answer is {ok, error, n, len} followed by ``len`` raw bytes. A value over MAX_VALUE_BYTES never
travels: the sender's call fails and closes the connection (a call announcing one is dropped unread). gloo
sets, waits for and gets one address per rank (~170 bytes); NCCL one 128-byte unique id.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from datetime import timedelta

import msgpack
import torch.distributed as dist

from kv_transfer.transports.tcp.protocol import recv_exact, recv_small, send_small
from kv_transfer.wire import WireError

MAX_KEYS = 64
MAX_KEY_BYTES = 512
MAX_VALUE_BYTES = 64 * 1024
MAX_SPACE_BYTES = 256 * 1024  # keys and values of one pair together
MAX_ERROR_CHARS = 1024
OVER_BOUND = "torch pair rendezvous store over its bound"
RPC_SLACK_S = 2.0  # a call's answer may come this long after the wait it asked for
OPS = ("set", "get", "wait", "add", "check", "delete_key", "compare_set", "append", "num_keys", "list_keys")


class KeySpace:
    """One pair's rendezvous keys. Thread-safe; ``get`` and ``wait`` block up to their timeout."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._error = ""  # set when closed or broken: every call then fails with it
        self.nbytes = 0  # keys and values held

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._put(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        with self._cond:
            self._await([key], timeout_s)
            return self._values[key]

    def wait(self, keys: list[str], timeout_s: float) -> None:
        with self._cond:
            self._await(keys, timeout_s)

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            self._raise_if_closed()
            try:
                value = int(self._values.get(key, b"0")) + amount
            except ValueError:
                raise dist.DistStoreError(f"pair store key {key!r} does not hold a number") from None
            self._put(key, str(value).encode())
            return value

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            self._raise_if_closed()
            return all(key in self._values for key in keys)

    def delete_key(self, key: str) -> bool:
        with self._cond:
            self._raise_if_closed()
            value = self._values.pop(key, None)
            if value is not None:
                self.nbytes -= len(key.encode()) + len(value)
            return value is not None

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """c10d's compare-and-set: ``desired`` when it was set (an absent key counts as ``b""``), else the
        value that stays."""
        with self._cond:
            self._raise_if_closed()
            current = self._values.get(key)
            if current == expected or (current is None and not expected):
                self._put(key, desired)
                return desired
            return expected if current is None else current

    def append(self, key: str, value: bytes) -> None:
        with self._cond:
            self._raise_if_closed()
            self._put(key, self._values.get(key, b"") + value)

    def num_keys(self) -> int:
        with self._cond:
            self._raise_if_closed()
            return len(self._values)

    def list_keys(self) -> list[str]:
        with self._cond:
            self._raise_if_closed()
            return list(self._values)

    def close(self, error: str) -> None:
        """Drop every key; every call from now on (blocked ones too) fails with ``error`` (the first one given)."""
        with self._cond:
            self._error = self._error or error
            self._values.clear()
            self.nbytes = 0
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return bool(self._error)

    def _raise_if_closed(self) -> None:
        if self._error:
            raise dist.DistStoreError(self._error)

    def _await(self, keys: list[str], timeout_s: float) -> None:
        """Caller holds the condition."""
        if not self._cond.wait_for(lambda: self._error or all(key in self._values for key in keys), timeout_s):
            raise dist.DistStoreError(f"pair store keys {keys} not set within {timeout_s:.1f} s")
        self._raise_if_closed()

    def _put(self, key: str, value: bytes) -> None:
        """Caller holds the condition. A write over a bound breaks the space: the pair's set-up fails."""
        self._raise_if_closed()
        old = self._values.get(key)
        key_bytes = len(key.encode())
        nbytes = self.nbytes + len(value) + (key_bytes if old is None else -len(old))
        over = (f"a key of {key_bytes} bytes (max {MAX_KEY_BYTES})" if key_bytes > MAX_KEY_BYTES
                else f"a value of {len(value)} bytes (max {MAX_VALUE_BYTES})" if len(value) > MAX_VALUE_BYTES
                else f"more than {MAX_KEYS} keys" if old is None and len(self._values) >= MAX_KEYS
                else f"more than {MAX_SPACE_BYTES} bytes in all" if nbytes > MAX_SPACE_BYTES else "")
        if over:
            self.close(f"{OVER_BOUND}: {over}")
            self._raise_if_closed()
        self._values[key] = value
        self.nbytes = nbytes
        self._cond.notify_all()


class RemoteSpace:
    """A KeySpace's calls over the pair's rendezvous connection (one at a time: NCCL may call from its own
    threads). Refusals and timeouts raise ``dist.DistStoreError``; a broken connection raises OSError."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, values=(value,))

    def get(self, key: str, timeout_s: float) -> bytes:
        return self._call("get", key, timeout_s=timeout_s)[1]

    def wait(self, keys: list[str], timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        for key in keys:  # one key a call, all within the one timeout
            self._call("wait", key, timeout_s=max(0.0, end - time.monotonic()))

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)[0]

    def check(self, keys: list[str]) -> bool:
        return all(self._call("check", key)[0] for key in keys)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", key)[0])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call("compare_set", key, values=(expected, desired))[1]

    def append(self, key: str, value: bytes) -> None:
        self._call("append", key, values=(value,))

    def num_keys(self) -> int:
        return self._call("num_keys")[0]

    def list_keys(self) -> list[str]:
        return msgpack.unpackb(self._call("list_keys")[1], raw=False, max_array_len=MAX_KEYS)

    def close(self) -> None:
        """Close the connection (a call in flight fails at once); the receiver then drops the pair's keys."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _call(self, op: str, key: str = "", n: int = 0, *, timeout_s: float = 0.0,
              values: tuple[bytes, ...] = ()) -> tuple[int, bytes]:
        sizes = [len(value) for value in values] + [0, 0]
        if max(sizes) > MAX_VALUE_BYTES:  # the receiver would not read it: the pair's set-up ends here
            self.close()
            raise dist.DistStoreError(f"{OVER_BOUND}: a value of {max(sizes)} bytes (max {MAX_VALUE_BYTES})")
        request = {"op": op, "key": key, "n": n, "timeout_ms": int(timeout_s * 1000), "len": sizes[0],
                   "len2": sizes[1]}
        with self._lock:
            self._sock.settimeout(timeout_s + RPC_SLACK_S)
            send_small(self._sock, request)
            self._sock.sendall(b"".join(values))
            reply = recv_small(self._sock)
            length = reply.get("len")
            if not isinstance(length, int) or not 0 <= length <= MAX_VALUE_BYTES:
                raise WireError(f"pair store answer of {length!r} bytes")
            value = bytes(recv_exact(self._sock, length))
        if not reply.get("ok"):
            raise dist.DistStoreError(str(reply.get("error")))
        return int(reply.get("n") or 0), value


class PairStore(dist.Store):
    """torch.distributed's Store over one pair's key space: a KeySpace or a RemoteSpace. ``get`` and a ``wait``
    that names no timeout wait at most the store's timeout."""

    def __init__(self, space: KeySpace | RemoteSpace, timeout: timedelta) -> None:
        super().__init__()
        self.space, self._timeout = space, timeout

    def set(self, key: str, value) -> None:
        self.space.set(key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self.space.get(key, self._timeout.total_seconds())

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.space.wait(list(keys), (self._timeout if timeout is None else timeout).total_seconds())

    def add(self, key: str, amount: int) -> int:
        return self.space.add(key, int(amount))

    def check(self, keys: list[str]) -> bool:
        return self.space.check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self.space.delete_key(key)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.space.compare_set(key, _as_bytes(expected), _as_bytes(desired))

    def append(self, key: str, value) -> None:
        self.space.append(key, _as_bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def num_keys(self) -> int:
        return self.space.num_keys()

    def list_keys(self) -> list[str]:
        return self.space.list_keys()

    def clone(self) -> PairStore:
        return self

    def has_extended_api(self) -> bool:
        return True

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout


def serve_store(conn: socket.socket, space: KeySpace) -> None:
    """Answer the pair's store calls on ``conn`` until the sender closes it.

    Raises WireError on a malformed call (a value over MAX_VALUE_BYTES is never read: the caller ends the
    connection, and with it the space) and OSError when the connection breaks.
    """
    while True:
        try:
            request = recv_small(conn)
        except ConnectionError:  # the sender closed the connection: it is done with the pair, or gone
            return
        op, key, n, timeout_ms = (request.get(name) for name in ("op", "key", "n", "timeout_ms"))
        sizes = [request.get("len"), request.get("len2")]
        if op not in OPS or not isinstance(key, str) or not all(isinstance(v, int) for v in (n, timeout_ms, *sizes)):
            raise WireError(f"malformed pair store call {str(request)[:200]}")
        if max(sizes) > MAX_VALUE_BYTES or min(sizes) < 0:
            raise WireError(f"{OVER_BOUND}: a value of {max(sizes)} bytes (max {MAX_VALUE_BYTES})")
        values = [bytes(recv_exact(conn, size)) for size in sizes]
        _answer(conn, space, op, key, n, max(0, timeout_ms) / 1000, values)


def _answer(conn: socket.socket, space: KeySpace, op: str, key: str, n: int, timeout_s: float,
            values: list[bytes]) -> None:
    try:
        n, value = _apply(space, op, key, n, timeout_s, *values)
        reply = {"ok": True, "error": "", "n": n, "len": len(value)}
    except dist.DistStoreError as exc:
        value, reply = b"", {"ok": False, "error": str(exc)[:MAX_ERROR_CHARS], "n": 0, "len": 0}
    send_small(conn, reply)
    conn.sendall(value)


def _apply(space: KeySpace, op: str, key: str, n: int, timeout_s: float, first: bytes,
           second: bytes) -> tuple[int, bytes]:
    """One call on the space: -> (its number, its value)."""
    if op == "set":
        space.set(key, first)
    elif op == "get":
        return 0, space.get(key, timeout_s)
    elif op == "wait":
        space.wait([key], timeout_s)
    elif op == "add":
        return space.add(key, n), b""
    elif op == "check":
        return int(space.check([key])), b""
    elif op == "delete_key":
        return int(space.delete_key(key)), b""
    elif op == "compare_set":
        return 0, space.compare_set(key, first, second)
    elif op == "append":
        space.append(key, first)
    elif op == "num_keys":
        return space.num_keys(), b""
    else:  # list_keys
        return 0, msgpack.packb(space.list_keys())
    return 0, b""


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
