"""`free_port`: a port for a server bound a little later, outside the range the kernel hands out itself."""
from __future__ import annotations

import socket

from engine.parallel import group
from engine.parallel.group import free_port


def test_a_drawn_port_is_free_and_below_the_ephemeral_range():
    low = group._ephemeral_low()
    ports = {free_port() for _ in range(20)}
    if low - group.SAFE_LOW >= 1024:
        assert all(group.SAFE_LOW <= port < low for port in ports), ports
        assert len(ports) > 1                      # drawn at random, not one fixed port
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))            # nothing listens there


def test_a_port_in_use_is_never_drawn(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(group, "_ephemeral_low", lambda: group.SAFE_LOW + 1024)
        monkeypatch.setattr(group.random.SystemRandom, "randrange", lambda self, a, b: busy)
        port = free_port()                          # every draw is the busy port: the kernel picks
        assert port != busy
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    kernels = group._ephemeral_low()
    monkeypatch.setattr(group, "_ephemeral_low", lambda: group.SAFE_LOW + 10)
    port = free_port()
    assert port >= kernels                          # from the kernel's own range
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
