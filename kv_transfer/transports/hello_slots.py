"""HelloSlots: the connections of a listener that have not authenticated yet (tcp and torch receivers).

At most ``limit`` connections are in their hello at once; a new one takes the oldest one's slot (that one
is dropped), so peers that never authenticate, however many and however slow, cannot keep a sender out.
Each has one deadline for its whole hello (a TLS handshake included), however slowly its bytes come. A
connection dropped before it authenticated (malformed, out of time, evicted) is counted and logged as one
WARNING per ``BAD_HELLO_LOG_S`` at most, never with a traceback.

    slots.admit(conn)           # on accept: a slot and a deadline (the oldest may be dropped)
    slots.swap(conn, wrapped)   # the socket now speaks through `wrapped` (TLS): same slot, same deadline
    slots.release(conn)         # the hello ended with a reply: False when it lost its slot meanwhile
    slots.drop(conn, why)       # the hello broke: counted, unless it was already
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_HELLOS = 32  # connections still in their hello; beyond, the oldest is dropped to make room
BAD_HELLO_LOG_S = 60.0  # at most one WARNING per this many seconds about dropped hellos


class HelloSlots:
    def __init__(self, name: str, timeout_s: float, count: Callable[[], int], limit: int = MAX_HELLOS) -> None:
        """``name``: the listener in log lines; ``count``: counts one dropped hello, returns how many so far."""
        self.name, self.timeout_s, self.limit = name, timeout_s, limit
        self._count = count
        self._slots: dict[int, tuple[socket.socket, threading.Timer]] = {}  # slot -> (its socket, deadline)
        self._slot_of: dict[int, int] = {}  # id(socket) -> its slot; slots are numbered, never reused
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._logged_at = -BAD_HELLO_LOG_S

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def admit(self, conn: socket.socket) -> None:
        """Give ``conn`` a slot and start its deadline; when every slot is taken the oldest makes room."""
        slot = next(self._numbers)
        deadline = threading.Timer(self.timeout_s, self._expire, (slot,))
        deadline.daemon = True
        with self._lock:
            self._slots[slot], self._slot_of[id(conn)] = (conn, deadline), slot
            oldest = next(iter(self._slots.values()))[0] if len(self._slots) > self.limit else None
        deadline.start()
        if oldest is not None:
            self.drop(oldest, "a newer connection needed its hello slot")

    def swap(self, conn: socket.socket, wrapped: socket.socket) -> bool:
        """``wrapped`` (e.g. the TLS socket made from ``conn``) takes ``conn``'s slot; False when it has none."""
        with self._lock:
            slot = self._slot_of.pop(id(conn), None)
            if slot is None:
                return False
            self._slot_of[id(wrapped)] = slot
            self._slots[slot] = (wrapped, self._slots[slot][1])
        return True

    def release(self, conn: socket.socket) -> bool:
        """Free the slot of ``conn``; False when it had none any more (dropped meanwhile, and counted)."""
        with self._lock:
            slot = self._slot_of.pop(id(conn), None)
            entry = None if slot is None else self._slots.pop(slot)
        if entry is not None:
            entry[1].cancel()
        return entry is not None

    def drop(self, conn: socket.socket, why: str) -> None:
        """Shut ``conn`` (its thread's read fails at once) and count it, unless it lost its slot before."""
        if not self.release(conn):
            return
        count = None if self._closed else self._count()  # closing: not the peer's fault
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        if count is None:
            return
        with self._lock:
            now = time.monotonic()
            quiet = now - self._logged_at < BAD_HELLO_LOG_S
            self._logged_at = self._logged_at if quiet else now
        if not quiet:
            log.warning("%s: dropped a connection before it authenticated (%s); %d so far; logged at most once "
                        "per %.0f s", self.name, why[:200], count, BAD_HELLO_LOG_S)

    def _expire(self, slot: int) -> None:
        with self._lock:
            entry = self._slots.get(slot)
        if entry is not None:
            self.drop(entry[0], f"no hello within {self.timeout_s:g} s")

    def close(self) -> None:
        """Drop every connection still in its hello, uncounted."""
        self._closed = True
        with self._lock:
            conns = [conn for conn, _ in self._slots.values()]
        for conn in conns:
            self.drop(conn, "closing")
