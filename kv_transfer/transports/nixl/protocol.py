"""The nixl transport's control connection: the mutual hello that exchanges agent metadata, then MACed messages.

One TCP connection per prefill sender and decode receiver, opened by the sender, the receiver's listener
bound to its host only. The hello (each message a u32 length | msgpack map, at most MAX_HELLO_BYTES):

    receiver -> sender   16-byte nonce N_r (fresh per connection)
    sender -> receiver   {nonce: N_s, proof, layout, mode, agent}                   proof = MAC("hello", N_r, N_s, body)
    receiver -> sender   {ok, error, layout, agent, [push: metadata, cache, staging], mac}
                                                                                    mac = MAC("reply", N_r, N_s, body)
    sender -> receiver   {[pull: metadata, cache, staging], mac}                    mac = MAC("meta", N_r, N_s, body)

MAC = HMAC-SHA256 under the tcp transport's hello key (``tcp.protocol.hello_key``: derived from the internal
secret, never sent) over length-prefixed parts, as the torch rendezvous makes its macs. Each end reveals its
agent metadata and region addresses only after the other proved the secret for this hello's nonces, and only
the end that starts transfers learns the other's: the decode side in pull mode, the prefill side in push mode.
A refusal is believed as it stands (it makes the sender do nothing).

Then every message, both ways, is ``u32 length | msgpack map | 32-byte MAC`` under the connection's channel
key (MAC("channel", N_r, N_s)) over (direction, sequence number, body): a message cannot be forged, replayed
or reordered. Kinds, by direction:

    sender -> receiver   region  {metadata, cache, staging}       the sender registered a new cache (pull)
                         chunk   {piece, header, src}             one chunk: packed wire header; where it is
                                 (pull: src = {blocks} cache cells or {offset, length} in staging; push: no src)
                         end     {piece}                          the piece's chunks are all sent (push: written)
                         abort   {piece, reason}                  the sender gave up on the piece
    receiver -> sender   landed  {piece, chunk, error}            pull: the chunk's READ ended (its staging is free)
                         dest    {piece, chunk, dst, error}       push: where to write the chunk ({blocks} or
                                                                  {offset, length}), or why not
                         ack     {piece, error}                   the piece is over: "" when every chunk landed

In push mode the WRITE of a chunk carries a NIXL notification (``landed_note``), MACed the same way, which
tells the receiver the chunk's bytes have landed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import threading

import msgpack

from kv_transfer.transports.tcp.protocol import LENGTH, NONCE_BYTES, recv_exact
from kv_transfer.wire import WireError

MAX_HELLO_BYTES = 64 * 1024     # agent metadata: a few hundred bytes on tcp/shm, a few KiB with RDMA devices
MAX_MESSAGE_BYTES = 1 << 20     # a chunk message: its header and up to a chunk's source block ids
MAC_BYTES = 32
SENDER, RECEIVER = b"S", b"R"   # who wrote a channel message
MODES = ("pull", "push")


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over the parts, each length-prefixed (no two part lists give the same message)."""
    return hmac.new(key, b"".join(LENGTH.pack(len(part)) + part for part in parts), hashlib.sha256).digest()


def body_bytes(message: dict) -> bytes:
    """A message's fields but ``mac``, packed (what its mac covers)."""
    return msgpack.packb({name: value for name, value in message.items() if name != "mac"}, use_bin_type=True)


def new_client_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def channel_key(key: bytes, server_nonce: bytes, client_nonce: str) -> bytes:
    return mac(key, b"channel", server_nonce, client_nonce.encode())


def send_hello(sock: socket.socket, message: dict) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    sock.sendall(LENGTH.pack(len(data)) + data)


def recv_hello(sock: socket.socket) -> dict:
    """One hello message (u32 length | msgpack map, at most MAX_HELLO_BYTES); WireError when malformed."""
    (length,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    if length > MAX_HELLO_BYTES:
        raise WireError(f"nixl hello of {length} bytes is over the limit of {MAX_HELLO_BYTES}")
    return _unpack(bytes(recv_exact(sock, length)), MAX_HELLO_BYTES)


def _unpack(data: bytes, limit: int) -> dict:
    try:
        value = msgpack.unpackb(data, raw=False, max_str_len=4096, max_bin_len=limit, max_array_len=limit // 2,
                                max_map_len=64)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireError(f"nixl control message is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(value, dict):
        raise WireError("nixl control message is not a map")
    return value


class Channel:
    """The MACed message stream of one authenticated connection (either end)."""

    def __init__(self, sock: socket.socket, key: bytes, me: bytes) -> None:
        self.sock, self.key = sock, key
        self._out, self._in = me, RECEIVER if me == SENDER else SENDER
        self._sent = self._received = 0
        self._send_lock = threading.Lock()

    def send(self, message: dict) -> None:
        data = msgpack.packb(message, use_bin_type=True)
        with self._send_lock:
            tag = mac(self.key, self._out, struct.pack("<Q", self._sent), data)
            self.sock.sendall(LENGTH.pack(len(data)) + data + tag)
            self._sent += 1

    def recv(self) -> dict:
        """The next message (one reader at a time); WireError when oversized, malformed or not authentic."""
        (length,) = LENGTH.unpack(recv_exact(self.sock, LENGTH.size))
        if length > MAX_MESSAGE_BYTES:
            raise WireError(f"nixl control message of {length} bytes is over the limit of {MAX_MESSAGE_BYTES}")
        data = bytes(recv_exact(self.sock, length + MAC_BYTES))
        body, tag = data[:length], data[length:]
        if not hmac.compare_digest(tag, mac(self.key, self._in, struct.pack("<Q", self._received), body)):
            raise WireError("nixl control message is not authenticated")
        self._received += 1
        return _unpack(body, MAX_MESSAGE_BYTES)


def landed_note(key: bytes, piece: int, chunk: int) -> bytes:
    """The NIXL notification a push WRITE carries: the chunk it lands and a MAC under the channel key."""
    return msgpack.packb([piece, chunk, mac(key, b"landed", struct.pack("<QQ", piece, chunk))], use_bin_type=True)


def parse_landed_note(key: bytes, note: bytes) -> tuple[int, int] | None:
    """(piece, chunk) of an authentic notification for this channel's key, else None."""
    try:
        piece, chunk, tag = msgpack.unpackb(note, raw=False, max_bin_len=MAC_BYTES, max_array_len=3)
        expected = mac(key, b"landed", struct.pack("<QQ", piece, chunk))
    except (ValueError, TypeError, struct.error, msgpack.UnpackException):
        return None
    return (piece, chunk) if isinstance(tag, bytes) and hmac.compare_digest(tag, expected) else None
