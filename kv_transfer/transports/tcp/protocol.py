"""The tcp transport's protocol: frames, the challenge/response hello, acks, scatter/gather socket I/O.

Every message starts with a fixed prefix ``FRAME`` (u32 kind | u32 header_len | u64 payload_len):
    CHUNK  msgpack chunk header (wire.ChunkHeader) | payload
    END    no body: the send() piece is over, the receiver answers with an ACK
    ABORT  header = reason (utf-8): the sender failed mid-piece, free what the piece reserved; ACK follows
and the receiver's ``ACK`` is u32 ok | u32 error_len | error (utf-8). The hello: the receiver speaks
first with a fresh nonce; the sender answers with a proof of the internal secret bound to that nonce
and its layout; the receiver replies with its layout or the refusal. The secret never travels.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import ssl
import struct
from collections.abc import Sequence

import msgpack

from proto.internal_auth import InternalTLS
from kv_transfer.wire import WireError, unpack_small

KIND_CHUNK, KIND_END, KIND_ABORT = 1, 2, 3
FRAME = struct.Struct("<IIQ")
ACK = struct.Struct("<II")
LENGTH = struct.Struct("<I")
MAX_HELLO_BYTES = 4096        # a layout description and a proof are ~300 bytes
MAX_ERROR_BYTES = 4096
NONCE_BYTES = 16
HELLO_TIMEOUT_S = 5.0         # a connection that has not said hello by then is dropped
HELLO_CONTEXT = b"pdserve-kv-tcp-v1"
IOV_MAX = 1024                # buffers one sendmsg / recvmsg_into takes (Linux UIO_MAXIOV)
SOCKET_BUFFER_BYTES = 0  # SO_SNDBUF / SO_RCVBUF; 0 leaves the kernel's autotuning on


def hello_key(token: str) -> bytes:
    """HMAC-SHA256(token, HELLO_CONTEXT): what proofs are made with; it never leaves the process."""
    return hmac.new(token.encode(), HELLO_CONTEXT, hashlib.sha256).digest()


def hello_proof(key: bytes, nonce: bytes) -> str:
    """The answer to one connection's challenge: bound to its nonce, so it cannot be replayed."""
    return hmac.new(key, b"hello|" + nonce, hashlib.sha256).hexdigest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def tune(sock: socket.socket) -> None:
    """No Nagle (END and ACK are tiny and must not wait for a delayed ack); room for chunks in flight."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def server_context(tls: InternalTLS) -> ssl.SSLContext:
    """Server side of the internal mutual TLS: present the node certificate, require one of the CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=tls.ca_path)
    context.load_cert_chain(tls.cert_path, tls.key_path)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: InternalTLS) -> ssl.SSLContext:
    """Client side: trust only the CA, present the node certificate."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_path)
    context.load_cert_chain(tls.cert_path, tls.key_path)
    return context


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port); ValueError naming the endpoint otherwise."""
    host, _, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit():
        raise ValueError(f"bad tcp KV endpoint {endpoint!r}; expected host:port")
    return host, int(port)


# --- socket I/O ---------------------------------------------------------------
_TIMEVAL = struct.Struct("@ll")


def set_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Bound each send and receive call by ``seconds`` (None: wait as long as it takes).

    A plain socket stays blocking and the kernel keeps the bound (SO_RCVTIMEO / SO_SNDTIMEO): a
    MSG_WAITALL read or a whole sendmsg is then one system call. Python's own timeouts would poll
    before every call and read only what has arrived, several times per chunk. TLS sockets keep
    Python's timeout.
    """
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
        return
    seconds = 0.0 if seconds is None else max(seconds, 0.001)
    timeval = _TIMEVAL.pack(int(seconds), int(seconds % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def blocking(sock: socket.socket) -> None:
    """Hand a connection's timeouts to ``set_timeout`` (plain sockets: blocking, no bound yet)."""
    sock.settimeout(None)
    set_timeout(sock, None)


def send_buffers(sock: socket.socket, buffers: Sequence) -> int:
    """Send every buffer in order with gathered writes (no joined copy); returns the bytes sent.

    TLS sockets cannot ``sendmsg``: each buffer then goes through ``sendall``. TimeoutError when
    the bound of ``set_timeout`` passes.
    """
    views = [view for view in (memoryview(b).cast("B") for b in buffers) if len(view)]
    total = sum(len(view) for view in views)
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return total
    index = 0
    while index < len(views):
        try:
            sent = sock.sendmsg(views[index : index + IOV_MAX])
        except BlockingIOError:  # SO_SNDTIMEO passed with nothing sent
            raise TimeoutError("send timed out") from None
        while sent:
            head = len(views[index])
            if sent >= head:
                sent -= head
                index += 1
            else:
                views[index] = views[index][sent:]
                sent = 0
    return total


def recv_buffers(sock: socket.socket, buffers: Sequence) -> int:
    """Fill every (writable) buffer in order with scattered reads; ConnectionError on EOF, TimeoutError when
    the bound of ``set_timeout`` passes."""
    views = [view for view in (memoryview(b).cast("B") for b in buffers) if len(view)]
    total = sum(len(view) for view in views)
    tls = isinstance(sock, ssl.SSLSocket)
    index = 0
    while index < len(views):
        if tls:
            got = sock.recv_into(views[index])
        else:
            try:
                got = sock.recvmsg_into(views[index : index + IOV_MAX], 0, socket.MSG_WAITALL)[0]
            except BlockingIOError:  # SO_RCVTIMEO passed with nothing received
                raise TimeoutError("receive timed out") from None
        if got == 0:
            raise ConnectionError("peer closed the connection")
        while got:
            head = len(views[index])
            if got >= head:
                got -= head
                index += 1
            else:
                views[index] = views[index][got:]
                got = 0
    return total


def recv_exact(sock: socket.socket, nbytes: int) -> bytearray:
    data = bytearray(nbytes)
    recv_buffers(sock, [data])
    return data


def send_small(sock: socket.socket, message: dict) -> None:
    """A length-prefixed msgpack map (hello, reply)."""
    data = msgpack.packb(message, use_bin_type=True)
    sock.sendall(LENGTH.pack(len(data)) + data)


def recv_small(sock: socket.socket) -> dict:
    """A length-prefixed msgpack map of at most MAX_HELLO_BYTES; WireError when larger or malformed."""
    (length,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    if length > MAX_HELLO_BYTES:
        raise WireError(f"hello of {length} bytes is over the limit of {MAX_HELLO_BYTES}")
    return unpack_small(bytes(recv_exact(sock, length)))


def send_ack(sock: socket.socket, error: str = "") -> None:
    data = error.encode()[:MAX_ERROR_BYTES]
    sock.sendall(ACK.pack(0 if error else 1, len(data)) + data)


def recv_ack(sock: socket.socket) -> str:
    """The receiver's verdict on a piece: "" when it took every chunk, else its error."""
    ok, length = ACK.unpack(recv_exact(sock, ACK.size))
    if length > MAX_ERROR_BYTES:
        raise WireError(f"ack error of {length} bytes is over the limit of {MAX_ERROR_BYTES}")
    error = bytes(recv_exact(sock, length)).decode(errors="replace")
    return "" if ok else error or "receiver refused the piece"
