"""HelloSlots: the connections of a listener that have not authenticated yet.

At most ``limit`` connections are in their hello at once; a new one takes the oldest one's slot (that one
is dropped), so peers that never authenticate, however many and however slow, cannot keep a sender out.
Each has one deadline for its whole hello, however slowly its bytes come. A connection dropped before it
authenticated (malformed, out of time, evicted) is counted and logged as one WARNING per
``BAD_HELLO_LOG_S`` at most, never with a traceback.

    slots.admit(conn)           # on accept: a slot and a deadline (the oldest may be dropped)
    slots.release(conn)         # the hello ended with a reply: False when it lost its slot meanwhile
    slots.drop(conn, why)       # the hello broke: counted, unless it was already
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from kv_transfer.transports.tcp.receiver import BAD_HELLO_LOG_S, MAX_HELLOS

log = logging.getLogger(__name__)


class HelloSlots:
    def __init__(self, name: str, timeout_s: float, count: Callable[[], int], limit: int = MAX_HELLOS) -> None:
        """``name``: the listener in log lines; ``count``: counts one dropped hello, returns how many so far."""
        self.name, self.timeout_s, self.limit = name, timeout_s, limit
        self._count = count
        self._hellos: dict[int, tuple[socket.socket, threading.Timer]] = {}  # oldest first
        self._lock = threading.Lock()
        self._closed = False
        self._logged_at = -BAD_HELLO_LOG_S

    def __len__(self) -> int:
        with self._lock:
            return len(self._hellos)

    def admit(self, conn: socket.socket) -> None:
        """Give ``conn`` a slot and start its deadline; when every slot is taken the oldest makes room."""
        deadline = threading.Timer(self.timeout_s, self.drop, (conn, f"no hello within {self.timeout_s:g} s"))
        deadline.daemon = True
        with self._lock:
            self._hellos[id(conn)] = (conn, deadline)
            oldest = next(iter(self._hellos.values()))[0] if len(self._hellos) > self.limit else None
        deadline.start()
        if oldest is not None:
            self.drop(oldest, "a newer connection needed its hello slot")

    def release(self, conn: socket.socket) -> bool:
        """Free the slot of ``conn``; False when it had none any more (dropped meanwhile, and counted)."""
        with self._lock:
            entry = self._hellos.pop(id(conn), None)
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

    def close(self) -> None:
        """Drop every connection still in its hello, uncounted."""
        self._closed = True
        with self._lock:
            conns = [conn for conn, _ in self._hellos.values()]
        for conn in conns:
            self.drop(conn, "closing")
