"""The torch transport's rendezvous: the authenticated handshake that opens a pair's store connection.

    receiver -> sender   16-byte nonce N_r (fresh per connection)
    sender -> receiver   {nonce: N_s, proof, layout, backend}        proof = MAC("hello", N_r, N_s)
    receiver -> sender   {ok, error, layout, index, mac}             mac = MAC("reply", N_r, N_s, the rest)

each message but the first framed by ``tcp.protocol.send_small`` (u32 length | msgpack map), MAC =
HMAC-SHA256 under ``rendezvous_key(token)`` over its length-prefixed parts. The receiver serves the pair's
store calls on the connection (``store.py``) only after a valid proof; the sender builds a group only on an
ok reply whose mac holds, i.e. one the receiver made for this very hello. A refusal is believed as it stands:
a sender with a wrong token cannot check the receiver's mac, and a refusal makes the sender do nothing. The
token and the key never travel.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
from collections.abc import Callable
from datetime import timedelta

import msgpack

from kv_transfer.interface import FailedSide, TransferError
from proto.internal_auth import token_matches
from kv_transfer.layout import HandshakeError
from kv_transfer.transports.tcp.protocol import LENGTH, NONCE_BYTES, recv_exact, recv_small, send_small, tune

RENDEZVOUS_CONTEXT = b"pdserve-kv-rendezvous-v2"


def rendezvous_key(token: str) -> bytes:
    """HMAC-SHA256(token, RENDEZVOUS_CONTEXT): the key proofs and macs are made with; it never leaves the process."""
    return hmac.new(token.encode(), RENDEZVOUS_CONTEXT, hashlib.sha256).digest()


def hello_proof(key: bytes, server_nonce: bytes, client_nonce: str) -> str:
    """The sender's answer to one connection's challenge: bound to both nonces, so it cannot be replayed."""
    return _mac(key, b"hello", server_nonce, client_nonce.encode())


def reply_mac(key: bytes, server_nonce: bytes, client_nonce: str, reply: dict) -> str:
    """The receiver's mac over its reply (every field but ``mac``, in order), bound to this hello's nonces."""
    body = msgpack.packb({name: value for name, value in reply.items() if name != "mac"}, use_bin_type=True)
    return _mac(key, b"reply", server_nonce, client_nonce.encode(), body)


def dial(host: str, port: int, key: bytes, hello: dict, left: Callable[[], timedelta]) -> tuple[socket.socket, dict]:
    """Connect to a receiver and pass its rendezvous: -> (the connection, which now carries the pair's store
    calls; the receiver's reply: layout, index).

    ``hello``: the layout description and backend. Each step waits at most ``left()`` (the time left of the
    whole set-up). Raises HandshakeError (a layout or backend mismatch) or TransferError when the receiver
    refuses, TransferError when an ok reply is not the receiver's, OSError or WireError when the exchange breaks.
    """
    sock = socket.create_connection((host, port), timeout=left().total_seconds())
    try:
        tune(sock)
        sock.settimeout(left().total_seconds())
        server_nonce = bytes(recv_exact(sock, NONCE_BYTES))
        client_nonce = secrets.token_hex(NONCE_BYTES)
        send_small(sock, {**hello, "nonce": client_nonce, "proof": hello_proof(key, server_nonce, client_nonce)})
        sock.settimeout(left().total_seconds())
        reply = recv_small(sock)
        if not reply.get("ok"):
            error = str(reply.get("error"))
            raise HandshakeError(error) if "mismatch" in error else TransferError(error, FailedSide.RECEIVER)
        if not token_matches(str(reply.get("mac", "")), reply_mac(key, server_nonce, client_nonce, reply)):
            raise TransferError(f"the torch rendezvous reply from {host}:{port} is not authenticated (not made "
                                f"under this cluster's secret for this hello)", FailedSide.TRANSPORT)
        if not isinstance(reply.get("layout"), dict) or not isinstance(reply.get("index"), int):
            raise TransferError(f"malformed torch rendezvous reply from {host}:{port}", FailedSide.TRANSPORT)
    except BaseException:
        sock.close()
        raise
    return sock, reply


def _mac(key: bytes, *parts: bytes) -> str:
    """Hex HMAC-SHA256 of the parts, each length-prefixed (no two part lists give the same message)."""
    return hmac.new(key, b"".join(LENGTH.pack(len(part)) + part for part in parts), hashlib.sha256).hexdigest()
