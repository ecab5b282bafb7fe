"""The HTTP front door's per-connection bounds (`router.openai_api.http_limits`), black-box over raw sockets.

Each test starts a router with HTTP on 127.0.0.1 and small limits (`LIMITS`): headers ≤ 4 KiB, 0.5 s for the
headers and for the body (plus 1 s per KiB received), 0.3 s idle keep-alive, 3 connections per client.
Waits are socket reads with a timeout; a limit that does not hold fails as "still open".
"""
from __future__ import annotations

import json
import logging
import re
import socket
import time

import pytest
from openai_support import REPLIES, ScriptedBackend

from deploy.cli import build_parser, config_from_args
from deploy.config import ConfigError
from router.metrics import Metrics
from router.openai_api.http_limits import HTTPLimits

MODEL = "m"
LIMITS = HTTPLimits(max_header_bytes=4096, header_timeout_s=0.5, body_timeout_s=0.5, min_body_bytes_per_s=1024,
                    keep_alive_timeout_s=0.3, max_connections_per_client=3)
SLACK_S = 1.5               # timer latency on a busy machine
BAD_TOKEN = b"Authorization: Bearer wrong\r\n"


@pytest.fixture
def http(serve):
    """Factory: a ready router with HTTP on a free port and `LIMITS` → Running."""
    def start(backend=None, limits=LIMITS, **kwargs):
        return serve(backend or ScriptedBackend(), http_port=0, model_name=MODEL, http_limits=limits, **kwargs)
    return start


def _connect(running) -> socket.socket:
    return socket.create_connection(("127.0.0.1", running.server.http_port), timeout=5)


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes; fails if it is still open after ``timeout``."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except socket.timeout:
        raise AssertionError(f"connection still open after {timeout}s (got {got[:80]!r})") from None
    except ConnectionResetError:
        pass
    return got


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response with a content-length: (status, body); the connection stays usable."""
    sock.settimeout(5)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {buf!r}"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split()[1]), rest[:length]


def _read_until(sock: socket.socket, marker: bytes, buf: bytes = b"") -> bytes:
    sock.settimeout(5)
    while marker not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"closed before {marker!r}: {buf[-200:]!r}"
        buf += chunk
    return buf


def _trickle(sock: socket.socket, piece: bytes, every_s: float = 0.05, for_s: float = 5.0) -> bytes:
    """Send ``piece`` every ``every_s`` (waiting on a read) until the server closes; what it sent back."""
    end = time.monotonic() + for_s
    got = b""
    sock.settimeout(every_s)
    while time.monotonic() < end:
        try:
            sock.sendall(piece)
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"connection still open after trickling for {for_s}s (got {got[:80]!r})")


def _stream_request(prompt: str = "Hi", max_tokens: int = 12) -> bytes:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


def _refused(metrics: Metrics, status: str, reason: str) -> float:
    return metrics.registry.get_sample_value("pdserve_rejected_requests_total",
                                             {"api": "http", "status": status, "reason": reason}) or 0.0


def _refusal_lines(caplog, reason: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", "") == "http_connection_refused"
            and r.fields["reason"] == reason]


def test_oversized_headers_get_431_and_the_connection_is_closed(http, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router")
    metrics = Metrics()
    running = http(metrics=metrics)
    with _connect(running) as sock:                   # one big header, its end never sent
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000)
        assert _read_until_closed(sock, 3).startswith(b"HTTP/1.1 431 ")
    with _connect(running) as sock:                   # many small ones, over the limit in all
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-Small: %s\r\n" % (b"b" * 50) * 100 + b"\r\n")
        answer = _read_until_closed(sock, 3)
        assert answer.startswith(b"HTTP/1.1 431 ") and b"connection: close" in answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "header_too_large"
    with _connect(running) as sock:                   # trickled in 512-byte pieces
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ")
        assert _trickle(sock, b"c" * 512).startswith(b"HTTP/1.1 431 ")
    with _connect(running) as sock:                   # a flood: the server stops reading at the limit
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Flood: ")
        num_sent, piece = 0, b"d" * 65536
        with pytest.raises(OSError):                  # reset by the server long before 64 MiB
            while num_sent < 64 << 20:
                sock.sendall(piece)
                num_sent += len(piece)
    with _connect(running) as sock:                   # under the limit: served as usual
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Fits: " + b"e" * 3000 + b"\r\n\r\n")
        status, body = _read_response(sock)
        assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
    assert _refused(metrics, "INVALID_ARGUMENT", "header_too_large") == 4
    [line] = _refusal_lines(caplog, "header_too_large")       # rate limited: one line for the four
    assert line.levelno == logging.WARNING and line.fields["http_status"] == 431 and not line.exc_info


def test_slow_headers_are_closed_within_the_header_timeout(http):
    metrics = Metrics()
    running = http(metrics=metrics)
    with _connect(running) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        answer = _trickle(sock, b"X")                  # a header name, one byte every 50 ms
        assert LIMITS.header_timeout_s * 0.8 <= time.monotonic() - started < LIMITS.header_timeout_s + SLACK_S
        assert answer.startswith(b"HTTP/1.1 408 ")
    assert _refused(metrics, "DEADLINE_EXCEEDED", "header_timeout") == 1


def test_a_silent_connection_is_closed_after_the_header_timeout(http):
    running = http()
    with _connect(running) as sock:
        started = time.monotonic()
        assert _read_until_closed(sock, 3) == b""     # nothing asked, nothing answered
        assert LIMITS.header_timeout_s * 0.8 <= time.monotonic() - started < LIMITS.header_timeout_s + SLACK_S
    assert running.server.http.guard.num_open("127.0.0.1") == 0


def test_a_slow_body_gets_408_and_is_closed(http, wait_until):
    metrics = Metrics()
    backend = ScriptedBackend()
    running = http(backend, metrics=metrics)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2000\r\n\r\n")
    with _connect(running) as sock:                    # trickled: behind the minimum pace
        started = time.monotonic()
        sock.sendall(head + b'{"model": "m", "prompt": "')
        answer = _trickle(sock, b"a")
        assert time.monotonic() - started < LIMITS.body_timeout_s + SLACK_S
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "body_timeout"
    with _connect(running) as sock:                    # stalled after a first piece
        sock.sendall(head + b'{"model": "m"')
        assert _read_until_closed(sock, 3).startswith(b"HTTP/1.1 408 ")
    assert _refused(metrics, "DEADLINE_EXCEEDED", "body_timeout") == 2
    assert not backend.inputs                          # nothing reached the backend
    wait_until(lambda: running.server.http.guard.num_open("127.0.0.1") == 0)


def test_an_idle_keep_alive_connection_is_closed(http):
    running = http()
    with _connect(running) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(sock)[0] == 200
        answered = time.monotonic()
        assert _read_until_closed(sock, 3) == b""
        assert time.monotonic() - answered < LIMITS.keep_alive_timeout_s + SLACK_S


def test_connections_over_the_per_client_cap_get_503_while_the_others_keep_streaming(http, caplog, wait_until):
    caplog.set_level(logging.INFO, logger="pdserve.router")
    metrics = Metrics()
    backend = ScriptedBackend()
    backend.pause_after = 2                           # every stream waits after two chunks until `resume`
    running = http(backend, metrics=metrics)
    streams = [_connect(running) for _ in range(LIMITS.max_connections_per_client)]
    try:
        buffers = []
        for sock in streams:
            sock.sendall(_stream_request())
            buffers.append(_read_until(sock, b"data: "))
        for _ in range(2):
            with _connect(running) as extra:
                started = time.monotonic()
                answer = _read_until_closed(extra, 3)
                assert answer.startswith(b"HTTP/1.1 503 ") and time.monotonic() - started < 1.0
                assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
        backend.resume.set()
        for sock, buf in zip(streams, buffers):       # the admitted streams run to their end
            buf = _read_until(sock, b"0\r\n\r\n", _read_until(sock, b"data: [DONE]", buf))
            texts = [json.loads(e)["choices"][0]["text"] for e in re.findall(rb"data: (\{.*\})", buf)]
            assert "".join(texts) == REPLIES[0]
    finally:
        for sock in streams:
            sock.close()
    wait_until(lambda: running.server.http.guard.num_open("127.0.0.1") == 0)
    with _connect(running) as sock:                   # the slots are free again
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(sock)[0] == 200
    assert _refused(metrics, "RESOURCE_EXHAUSTED", "too_many_connections") == 2
    assert len(_refusal_lines(caplog, "too_many_connections")) == 1


def test_a_connection_after_its_401_is_held_to_the_same_limits(http):
    metrics = Metrics()
    backend = ScriptedBackend()
    running = http(backend, metrics=metrics, token="s3cret")
    with _connect(running) as sock:                   # a body trickled on after the 401
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + BAD_TOKEN +
                     b"Content-Length: 100000\r\n\r\n{")
        assert _read_response(sock)[0] == 401
        answered = time.monotonic()
        assert _trickle(sock, b"a") == b""           # closed, nothing more answered
        assert time.monotonic() - answered < LIMITS.body_timeout_s + SLACK_S
    with _connect(running) as sock:                   # the next request's headers trickled after the 401
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + BAD_TOKEN + b"\r\n")
        assert _read_response(sock)[0] == 401
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        assert _trickle(sock, b"X").startswith(b"HTTP/1.1 408 ")
    with _connect(running) as sock:                   # idle after the 401
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + BAD_TOKEN + b"\r\n")
        assert _read_response(sock)[0] == 401
        answered = time.monotonic()
        assert _read_until_closed(sock, 3) == b""
        assert time.monotonic() - answered < LIMITS.keep_alive_timeout_s + SLACK_S
    with _connect(running) as sock:                   # oversized headers are refused before the token is read
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + BAD_TOKEN + b"X-Big: " + b"a" * 5000)
        assert _read_until_closed(sock, 3).startswith(b"HTTP/1.1 431 ")
    assert _refused(metrics, "DEADLINE_EXCEEDED", "body_timeout") == 1
    assert _refused(metrics, "DEADLINE_EXCEEDED", "header_timeout") == 1
    assert not backend.inputs


def test_a_stream_longer_than_every_timeout_and_a_large_body_still_work(http, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router")
    backend = ScriptedBackend()
    backend.pause_after = 1
    running = http(backend)
    longest_s = max(LIMITS.header_timeout_s, LIMITS.body_timeout_s, LIMITS.keep_alive_timeout_s)
    with _connect(running) as sock:
        sock.sendall(_stream_request())
        buf = _read_until(sock, b"data: ")
        sock.settimeout(longest_s + 0.5)              # the stream idles past every timeout ...
        with pytest.raises(socket.timeout):
            buf += sock.recv(65536)
        backend.resume.set()                          # ... and goes on to its end on the same connection
        buf = _read_until(sock, b"0\r\n\r\n", _read_until(sock, b"data: [DONE]", buf))
        texts = [json.loads(e)["choices"][0]["text"] for e in re.findall(rb"data: (\{.*\})", buf)]
        assert "".join(texts) == REPLIES[0]
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")   # and the connection is reusable
        assert _read_response(sock)[0] == 200
    prompt = "x" * (3 << 20)                          # 3 MiB at full speed: read whole, answered by the app
    body = json.dumps({"model": "other", "prompt": prompt, "max_tokens": 2}).encode()
    with _connect(running) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        status, answer = _read_response(sock)
        assert status == 404 and json.loads(answer)["error"]["param"] == "model"    # parsed, then refused
    assert not [r for r in caplog.records if getattr(r, "event", "") == "http_connection_refused"]


def _limits_of(*argv) -> object:
    return config_from_args(build_parser().parse_args(["serve", *argv])).server.http_limits


def test_config_keys_defaults_and_checks():
    assert HTTPLimits(**_limits_of().model_dump()) == HTTPLimits()
    assert (HTTPLimits().max_header_bytes, HTTPLimits().max_connections_per_client) == (64 * 1024, 256)
    limits = _limits_of("--set", "server.http_limits.header_timeout_s=2.5",
                        "--set", "server.http_limits.max_connections_per_client=8")
    assert (limits.header_timeout_s, limits.max_connections_per_client) == (2.5, 8)
    with pytest.raises(ConfigError, match="server.http_limits.body_timeout_s"):
        _limits_of("--set", "server.http_limits.body_timeout_s=0")
    with pytest.raises(ConfigError, match="server.http_limits.max_header_bytes"):
        _limits_of("--set", "server.http_limits.max_header_bytes=100")
    with pytest.raises(ConfigError, match="server.http_limits.max_conections"):
        _limits_of("--set", "server.http_limits.max_conections=8")
