"""What only the tcp transport does: codec none straight from and into the cache rows, mutual TLS, a connection
that breaks mid-piece, silent and surplus connections. (The generic transport tests run on tcp too.)"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import torch
from kv_helpers import TOKEN, assert_no_leak, random_cache, wait_for
from tls_support import make_certs

from kv_transfer import FailedSide, KVLayout, KVPiece, SimpleBlockPool, TransferSettings, TransferStatus, make_receiver
from kv_transfer import make_sender
from kv_transfer.codec import NoneCodec
from proto.internal_auth import InternalTLS
from kv_transfer.transports.tcp import receiver as tcp_receiver
from kv_transfer.transports.tcp.protocol import (FRAME, KIND_CHUNK, KIND_END, NONCE_BYTES, client_context,
                                                 hello_key, hello_proof, recv_ack, recv_exact, recv_small, send_small)
from kv_transfer.transports.tcp.rows import cell_runs
from kv_transfer.wire import ChunkHeader, pack_header


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def node_tls(certs, name: str = "node") -> InternalTLS:
    return InternalTLS(str(certs / f"{name}.pem"), str(certs / f"{name}.key"), str(certs / "ca.pem"))


def test_cell_runs_merge_adjacent_cells_in_payload_order():
    # cache of 10 blocks, cells of 100 bytes: layer 1, blocks 4, 5, 6 then 2 -> one run of three cells, one of one
    assert cell_runs(10, 100, (1, 2), [4, 5, 6, 2]) == [(1400, 1700), (1200, 1300)]
    # every block of two layers in order is one run
    assert cell_runs(3, 8, (0, 2), [0, 1, 2]) == [(0, 48)]
    assert cell_runs(3, 8, (0, 2), [2, 0]) == [(16, 24), (0, 8), (40, 48), (24, 32)]


def test_codec_none_never_gathers_nor_scatters_a_copy(make_pair, layout, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the codec ran: a gathered or staged copy was made")

    monkeypatch.setattr(NoneCodec, "encode_from", refuse)
    monkeypatch.setattr(NoneCodec, "decode_into", refuse)
    pair = make_pair("tcp", layout, chunk_bytes=200)
    pair.pool.take([1, 4])
    src = random_cache(layout, 8, seed=5)
    handle = pair.sender.send(KVPiece("r", src, [7, 2, 3, 0, 6], num_tokens=20, handoff=b"h"), pair.dest)
    assert handle.wait(30) == TransferStatus.DONE, handle
    result = pair.receiver.wait(handle.transfer_id, 10)
    assert result.dst_block_ids == [0, 2, 3, 5, 6] and result.handoff == b"h"
    expected = src[:, [7, 2, 3, 0, 6]]
    assert torch.equal(pair.dst_cache[:, result.dst_block_ids].view(torch.uint8), expected.view(torch.uint8))
    assert handle.wire_bytes > src[:, :5].numel() * 4  # the payload plus frames
    assert_no_leak(pair.pool, [1, 4] + result.dst_block_ids)


@pytest.mark.parametrize("codec", ["none", "fp8"])
def test_mutual_tls_refuses_plaintext_and_transfers(layout, certs, codec):
    settings = TransferSettings(transport="tcp", codec=codec, token=TOKEN, tls=node_tls(certs))
    pool = SimpleBlockPool(16)
    dst = torch.zeros(layout.cache_shape(16), dtype=layout.dtype)
    receiver = make_receiver(settings, layout, dst, pool, hello_timeout_s=1.0)  # (plaintext hangs until then)
    senders = [make_sender("tcp", layout, codec=codec, token=TOKEN),
               make_sender("tcp", layout, codec=codec, token=TOKEN, tls=node_tls(certs, "rogue")),
               make_sender(settings, layout)]
    try:
        assert receiver.endpoint.startswith("127.0.0.1:")
        src = random_cache(layout, 4)
        for refused in senders[:2]:  # plaintext; a certificate of another CA
            handle = refused.send(KVPiece("r", src, [0, 1]), receiver.endpoint)
            assert handle.wait(30) == TransferStatus.FAILED and handle.failed_side == FailedSide.TRANSPORT, handle
        handle = senders[2].send(KVPiece("tls", src, [2, 0, 3], num_tokens=9, handoff=b"x"), receiver.endpoint)
        assert handle.wait(30) == TransferStatus.DONE, handle
        result = receiver.wait(handle.transfer_id, 10)
        assert result.status == TransferStatus.DONE and (result.num_tokens, result.handoff) == (9, b"x")
        got, expected = dst[:, result.dst_block_ids].float(), src[:, [2, 0, 3]].float()
        if codec == "none":
            assert torch.equal(got, expected)
        else:
            assert float((got - expected).norm() / expected.norm()) < 0.04
        assert receiver.stats.auth_failures == 0
        assert_no_leak(pool, result.dst_block_ids)
    finally:
        for sender in senders:
            sender.close()
        receiver.close()


def test_connection_broken_mid_piece_frees_blocks_and_the_next_send_reconnects(make_pair, layout, monkeypatch):
    pair = make_pair("tcp", layout, chunk_bytes=200)
    real, calls, cell_bytes = tcp_receiver.recv_buffers, [], layout.block_numel * 4

    def breaks_on_the_third_chunk(conn, buffers):
        if sum(len(b) for b in buffers) == cell_bytes:  # a chunk's payload (one cell here)
            calls.append(True)
            if len(calls) == 3:
                conn.shutdown(socket.SHUT_RDWR)  # as if the link dropped
                # what the read sees then; the real read could still return a chunk the kernel had queued
                # before the shutdown, and finish the transfer (the test was flaky, DONE 3 runs in 5)
                raise ConnectionError("peer closed the connection")
        return real(conn, buffers)

    monkeypatch.setattr(tcp_receiver, "recv_buffers", breaks_on_the_third_chunk)
    src = random_cache(layout, 6)
    handle = pair.sender.send(KVPiece("r", src, [1, 2, 3, 4]), pair.dest)
    assert handle.wait(30) == TransferStatus.FAILED and handle.failed_side == FailedSide.TRANSPORT, handle
    result = pair.receiver.wait(handle.transfer_id, 10)
    assert result.status == TransferStatus.FAILED and "disconnected" in result.error
    assert_no_leak(pair.pool)
    monkeypatch.undo()
    ok = pair.sender.send(KVPiece("r2", src, [5, 0]), pair.dest)
    assert ok.wait(30) == TransferStatus.DONE, ok
    done = pair.receiver.wait(ok.transfer_id, 10)
    assert torch.equal(pair.dst_cache[:, done.dst_block_ids], src[:, [5, 0]])
    assert_no_leak(pair.pool, done.dst_block_ids)


def _tcp_receiver(layout, **kwargs):
    pool = SimpleBlockPool(8)
    dst = torch.zeros(layout.cache_shape(8), dtype=layout.dtype)
    return pool, make_receiver("tcp", layout, dst, pool, token=TOKEN, **kwargs)


def _connect(receiver, tls: InternalTLS | None = None) -> socket.socket:
    host, port = receiver.endpoint.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)))
    if tls is not None:
        conn = client_context(tls).wrap_socket(conn, server_hostname=host)
    assert len(conn.recv(64)) > 0       # the challenge
    return conn


def _transfers(sender, receiver, pool, layout) -> None:
    handle = sender.send(KVPiece("r", random_cache(layout, 3), [0, 2]), receiver.endpoint)
    assert handle.wait(30) == TransferStatus.DONE, handle
    owned = receiver.wait(handle.transfer_id, 5).dst_block_ids
    assert_no_leak(pool, owned)
    pool.free(owned)                    # as the decode worker does once the request ends


def test_silent_and_surplus_connections_are_dropped(layout):
    pool, receiver = _tcp_receiver(layout, hello_timeout_s=0.5, max_connections=1)
    sender, other = make_sender("tcp", layout, token=TOKEN), make_sender("tcp", layout, token=TOKEN)
    silent = [_connect(receiver) for _ in range(3)]
    try:
        assert wait_for(lambda: receiver.num_connections == 0, timeout=10)  # the silent ones, after 0.5 s
        assert receiver.stats.bad_hellos == 3
        _transfers(sender, receiver, pool, layout)
        assert receiver.num_connections == 1  # the sender keeps its connection for the next piece
        handle = other.send(KVPiece("r2", random_cache(layout, 3), [1]), receiver.endpoint)   # over max_connections
        assert handle.wait(30) == TransferStatus.FAILED
        _transfers(sender, receiver, pool, layout)                                     # the first still works
    finally:
        for conn in silent:
            conn.close()
        sender.close()
        other.close()
        receiver.close()


@pytest.mark.parametrize("tls", [False, True])
def test_a_slow_drip_hello_is_dropped_at_one_deadline(layout, certs, tls):
    """Over TLS too: the deadline that started on the plain socket reaches the TLS socket made from it."""
    _, receiver = _tcp_receiver(layout, hello_timeout_s=0.6, tls=node_tls(certs) if tls else None)
    conn = _connect(receiver, node_tls(certs) if tls else None)
    started = time.monotonic()
    dropped = False
    try:
        conn.sendall((100).to_bytes(4, "little"))       # a 100-byte hello ...
        for _ in range(60):                             # ... a byte each 0.1 s: no single read ever waits long
            try:
                conn.sendall(b"\x01")
            except OSError:
                dropped = True
                break
            if wait_for(lambda: receiver.num_connections == 0, timeout=0.1):
                dropped = True
                break
        assert dropped and time.monotonic() - started < 4       # near 0.6 s, not 100 reads later
    finally:
        conn.close()
        receiver.close()
    assert receiver.stats.bad_hellos == 1


def test_peers_that_never_authenticate_do_not_starve_senders(layout, monkeypatch):
    monkeypatch.setattr(tcp_receiver, "MAX_HELLOS", 4)
    pool, receiver = _tcp_receiver(layout, hello_timeout_s=60.0, max_connections=2)
    sender = make_sender("tcp", layout, token=TOKEN)
    silent = [_connect(receiver) for _ in range(12)]        # far more than the hello slots, held for 60 s
    try:
        assert wait_for(lambda: receiver.num_connections <= 4, timeout=10)
        _transfers(sender, receiver, pool, layout)
        silent += [_connect(receiver) for _ in range(12)]   # more after the sender authenticated
        _transfers(sender, receiver, pool, layout)          # its connection has a slot of its own
    finally:
        for conn in silent:
            conn.close()
        sender.close()
        receiver.close()


def test_malformed_hellos_are_one_rate_limited_warning_and_counted(layout, caplog):
    _, receiver = _tcp_receiver(layout)
    caplog.set_level(logging.WARNING)
    try:
        for garbage in (b"\xc1\xc1\xc1", b"\x92\x01", b"\xff" * 8):        # not msgpack, not a map, junk
            conn = _connect(receiver)
            conn.sendall(len(garbage).to_bytes(4, "little") + garbage)
            assert conn.recv(64) == b""           # closed
            conn.close()
        assert wait_for(lambda: receiver.stats.bad_hellos == 3, timeout=10)
    finally:
        receiver.close()
    mine = [r for r in caplog.records if r.name.startswith("kv_transfer")]
    assert [r.levelno for r in mine] == [logging.WARNING] and not any(r.exc_info for r in mine)
    assert "before it authenticated" in mine[0].getMessage()


def _hello(receiver, layout_description: object) -> tuple[socket.socket, dict]:
    """A connection that answers the challenge with a good proof, and what the receiver replied."""
    host, port = receiver.endpoint.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=10)
    nonce = recv_exact(conn, NONCE_BYTES)
    send_small(conn, {"proof": hello_proof(hello_key(TOKEN), nonce), "layout": layout_description})
    return conn, recv_small(conn)


def test_a_malformed_layout_in_a_hello_is_refused_with_a_reply(layout, caplog):
    _, receiver = _tcp_receiver(layout)
    caplog.set_level(logging.WARNING)
    try:
        for malformed in ("a layout", {**layout.describe("none"), "kv_head_start": "x"}):
            conn, reply = _hello(receiver, malformed)   # was: no reply, a closed connection, a logged traceback
            conn.close()
            assert reply["ok"] is False and "KV handshake" in reply["error"], reply
        assert receiver.stats.handshake_failures == 2
    finally:
        receiver.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _chunk_header(layout, **fields) -> ChunkHeader:
    values = dict(request_id="r", transfer_id="t", model_fingerprint=layout.model_fingerprint,
                  num_layers=layout.num_layers, layer_start=0, layer_end=1, num_blocks=1, block_start=0, block_end=1,
                  block_size=layout.block_size, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                  dtype="float32", codec="none", scale_layout="", chunk_index=0, num_chunks=1, payload_len=256,
                  checksum=0, deadline_ms=5000, num_tokens=layout.block_size)
    return ChunkHeader(**{**values, **fields})


@pytest.mark.parametrize("codec", ["none", "fp8"])   # received into the cache rows / staged for decode
def test_a_chunk_of_another_codec_or_model_is_refused_in_its_ack_before_anything_is_staged(layout, codec, caplog,
                                                                                           monkeypatch):
    pool, receiver = _tcp_receiver(layout, codec=codec)
    staged, acquire = [], tcp_receiver.payload_pool.acquire
    monkeypatch.setattr(tcp_receiver.payload_pool, "acquire", lambda *args: staged.append(args) or acquire(*args))
    caplog.set_level(logging.WARNING)
    sender = make_sender("tcp", layout, codec=codec, token=TOKEN)
    conn, reply = _hello(receiver, receiver.describe())
    try:
        assert reply["ok"], reply
        refused = [("t1", {"codec": "bogus"}, "codec: sender='bogus'"),
                   ("t2", {"codec": codec, "model_fingerprint": "other"}, "model_fingerprint")]
        for transfer_id, fields, needle in refused:
            header = pack_header(_chunk_header(layout, transfer_id=transfer_id, **fields))
            conn.sendall(FRAME.pack(KIND_CHUNK, len(header), 256) + header + bytes(256))
            conn.sendall(FRAME.pack(KIND_END, 0, 0))
            assert needle in recv_ack(conn)     # the connection stays in step (an unknown codec used to drop it)
            assert receiver.wait(transfer_id, 5).status == TransferStatus.FAILED
        assert staged == [] and receiver.num_connections == 1
        handle = sender.send(KVPiece("r", random_cache(layout, 3), [0, 2]), receiver.endpoint)
        assert handle.wait(30) == TransferStatus.DONE, handle
        assert_no_leak(pool, receiver.wait(handle.transfer_id, 5).dst_block_ids)
    finally:
        conn.close()
        sender.close()
        receiver.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("frame, message", [
    (FRAME.pack(99, 0, 0), "bad tcp frame (kind 99"),
    (FRAME.pack(KIND_CHUNK, 100, 1 << 40), "over the limits"),      # a TiB payload: refused before a read
    (FRAME.pack(KIND_END, 1 << 30, 0), "bad tcp frame (kind 2"),
], ids=["unknown_kind", "tib_payload", "gib_end_reason"])
def test_a_bad_frame_after_the_hello_closes_the_connection_with_one_warning(layout, caplog, frame, message):
    pool, receiver = _tcp_receiver(layout)
    sender = make_sender("tcp", layout, token=TOKEN)
    caplog.set_level(logging.WARNING)
    conn, reply = _hello(receiver, receiver.describe())
    try:
        assert reply["ok"], reply
        conn.sendall(frame)
        assert conn.recv(64) == b""                     # closed
        assert wait_for(lambda: receiver.num_connections == 0, timeout=10)
        _transfers(sender, receiver, pool, layout)      # other senders are served
    finally:
        conn.close()
        sender.close()
        receiver.close()
    mine = [r for r in caplog.records if r.name.startswith("kv_transfer")]
    assert [r.levelno for r in mine] == [logging.WARNING] and message in mine[0].getMessage()   # was: no line


def test_bfloat16_cache_round_trip_through_the_rows(make_pair):
    layout = KVLayout(2, 2, 16, 64, torch.bfloat16, "m")
    pair = make_pair("tcp", layout)
    src = random_cache(layout, 40, seed=9)
    ids = list(range(3, 35))  # 32 blocks x 2 layers x 8 KiB: several 1 MiB chunks, contiguous runs
    handle = pair.sender.send(KVPiece("r", src, ids), pair.dest)
    assert handle.wait(30) == TransferStatus.DONE, handle
    result = pair.receiver.wait(handle.transfer_id, 10)
    assert torch.equal(pair.dst_cache[:, result.dst_block_ids].view(torch.uint8), src[:, ids].view(torch.uint8))


def test_a_stalled_receiver_expires_the_send_at_its_deadline(make_pair, layout, monkeypatch):
    pair = make_pair("tcp", layout)
    pair.sender.handshake(pair.dest)
    stall, real = threading.Event(), tcp_receiver.TcpReceiver._receive_into_rows

    def stalled(self, conn, piece, header):
        stall.wait(30)  # the receiver stops reading: the sender's wait for the ACK is bounded by the deadline
        return real(self, conn, piece, header)

    monkeypatch.setattr(tcp_receiver.TcpReceiver, "_receive_into_rows", stalled)
    start = time.monotonic()
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 3), [0, 1], deadline_s=1.0), pair.dest)
    assert handle.wait(30) == TransferStatus.EXPIRED and handle.failed_side == FailedSide.TRANSPORT, handle
    assert 0.9 < time.monotonic() - start < 10 and "deadline" in handle.error
    stall.set()
    # the chunks were in the receiver's socket before the sender gave up: the receiver may still complete
    # the transfer (the decode worker parks such a DONE and frees it after its lease), or fail it; either
    # way it ends, and nothing but a DONE transfer's blocks stays reserved
    result = pair.receiver.wait(handle.transfer_id, 10)
    assert result is not None and result.status in (TransferStatus.DONE, TransferStatus.FAILED)
    assert_no_leak(pair.pool, result.dst_block_ids)


@pytest.mark.parametrize("strided", ["blocks", "rows"])
def test_strided_caches_are_sent_from_their_runs_or_staged(layout, strided):
    """Every other block of a cache: its cells are still byte runs (sent from and received into in place); a cache
    whose rows are transposed has none (as a device cache): sent from encoded chunks, received into staging."""
    pool = SimpleBlockPool(8)
    if strided == "blocks":
        dst_storage = torch.zeros(layout.cache_shape(16), dtype=layout.dtype)
        dst = dst_storage[:, ::2]  # [L, 8, 2, H, B, D], not contiguous
        src = random_cache(layout, 12, seed=4)[:, ::2]  # 6 blocks, strided
    else:
        L, _, two, H, B, D = layout.cache_shape(8)
        dst_storage = torch.zeros(L, 8, two, H, D, B, dtype=layout.dtype)
        dst = dst_storage.transpose(-1, -2)
        src = random_cache(layout, 6, seed=4).transpose(-1, -2).contiguous().transpose(-1, -2)
    receiver = make_receiver("tcp", layout, dst, pool, token=TOKEN)
    sender = make_sender("tcp", layout, token=TOKEN, chunk_bytes=200)
    try:
        assert (receiver._rows is None) == (strided == "rows")
        handle = sender.send(KVPiece("r", src, [5, 0, 2]), receiver.endpoint)
        assert handle.wait(30) == TransferStatus.DONE, handle
        result = receiver.wait(handle.transfer_id, 10)
        assert torch.equal(dst[:, result.dst_block_ids], src[:, [5, 0, 2]])
        untouched = [b for b in range(8) if b not in result.dst_block_ids]
        assert not dst[:, untouched].any() and (strided == "rows" or not dst_storage[:, 1::2].any())
        assert_no_leak(pool, result.dst_block_ids)
    finally:
        sender.close()
        receiver.close()
