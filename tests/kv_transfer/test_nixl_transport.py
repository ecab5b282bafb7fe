"""The nixl transport in one process (two agents): bit-exact cells cache to cache, layer-wise pieces and a
prefix skip, fp8 / int8 as the other transports decode them, every ending freeing both sides, the MACed
hello and notifications, loopback-only listeners, config and environment."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time

import msgpack
import pytest
import torch
import xxhash
from kv_helpers import TOKEN, assert_no_leak, random_cache, wait_for

from kv_transfer import FailedSide, KVLayout, KVPiece, TransferStatus
from kv_transfer import codec as kv_codec
from kv_transfer.transports.nixl import agent as nixl_agent
from kv_transfer.transports.nixl import sender as nixl_sender
from kv_transfer.transports.nixl.protocol import landed_note, parse_landed_note, recv_hello, send_hello
from kv_transfer.transports.tcp.protocol import NONCE_BYTES, hello_key, recv_exact

UNAVAILABLE = nixl_agent.available()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"nixl cannot be imported: {UNAVAILABLE}")
MODES = ["pull", "push"]


def nixl_pair(make_pair, layout, mode="pull", codec="none", **kwargs):
    """A nixl sender and receiver over a fresh pool (``receiver_options`` for the receiver's own keywords)."""
    options = {"mode": mode, **kwargs.pop("receiver_options", {})}
    return make_pair("nixl", layout, codec=codec, receiver_options=options, mode=mode, **kwargs)


def assert_both_sides_clean(pair) -> None:
    """Nothing in flight, no block held back, no staging slot taken, on either end."""
    receiver, sender = pair.receiver, pair.sender
    assert wait_for(lambda: receiver.num_in_flight == 0 and receiver.held.num_deferred == 0, 5)
    for end in (receiver, sender):
        assert end.staging is None or end.staging.num_used == 0


def cell_digest(cache: torch.Tensor, block_ids) -> int:
    return xxhash.xxh3_64_intdigest(cache[:, list(block_ids)].contiguous().view(torch.uint8).numpy())


@pytest.mark.parametrize("mode", MODES)
def test_layer_pieces_with_a_prefix_skip_arrive_bit_exact(make_pair, layout, mode):
    src = random_cache(layout, 10, seed=4)
    prompt_blocks = [7, 2, 9, 0, 5, 3]               # the prompt's blocks on the prefill side, in token order
    skip = 2                                         # the decode side holds (pinned) the first two
    pair = nixl_pair(make_pair, layout, mode, num_dst_blocks=16, chunk_bytes=300)
    pinned = pair.pool.allocate(skip)
    pair.pool.take([4])                              # a hole: the destinations are not one run
    sent = prompt_blocks[skip:]
    handles = [pair.sender.send(KVPiece("r", src, sent, transfer_id="t", layers=(layer, layer + 1), num_tokens=21),
                                pair.dest) for layer in (2, 0)]
    assert all(handle.wait(30) == TransferStatus.DONE for handle in handles), handles
    assert pair.receiver.status("t") == TransferStatus.TRANSFERRING      # layer 1 still missing
    last = pair.sender.send(KVPiece("r", src, sent, transfer_id="t", layers=(1, 2), num_tokens=21,
                                    first_token_id=9, handoff=b"first token"), pair.dest)
    assert last.wait(30) == TransferStatus.DONE, last
    result = pair.receiver.wait("t", 10)
    assert result.status == TransferStatus.DONE and result.dst_block_ids == [2, 3, 5, 6]
    assert (result.num_tokens, result.first_token_id, result.handoff) == (21, 9, b"first token")
    assert cell_digest(pair.dst_cache, result.dst_block_ids) == cell_digest(src, sent)
    assert torch.equal(pair.dst_cache[:, result.dst_block_ids].view(torch.uint8), src[:, sent].view(torch.uint8))
    untouched = [b for b in range(16) if b not in result.dst_block_ids]
    assert not bool(pair.dst_cache[:, untouched].any())
    assert result.nbytes == len(sent) * src[:, 0].numel() * 4
    assert_no_leak(pair.pool, pinned + [4] + result.dst_block_ids)
    assert_both_sides_clean(pair)


@pytest.mark.parametrize("workers", [1, 3])
def test_concurrent_pieces_land_bit_exact_on_any_number_of_workers(make_pair, layout, workers):
    """Pieces sent from several threads at once, READ by ``workers`` threads on as many UCX workers."""
    src = random_cache(layout, 24, seed=workers)
    pair = nixl_pair(make_pair, layout, num_dst_blocks=32, chunk_bytes=300, workers=workers,
                     receiver_options={"workers": workers})
    for end in (pair.sender, pair.receiver):
        assert end.agent.backend_params()["num_workers"] == str(workers)
    pieces = {f"t{i}": list(range(1 + 4 * i, 5 + 4 * i)) for i in range(5)}
    handles = {}

    def send(transfer_id):
        piece = KVPiece(transfer_id, src, pieces[transfer_id], transfer_id=transfer_id, num_tokens=16)
        handles[transfer_id] = pair.sender.send(piece, pair.dest)

    threads = [threading.Thread(target=send, args=(transfer_id,)) for transfer_id in pieces]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(handle.wait(30) == TransferStatus.DONE for handle in handles.values()), handles
    for transfer_id, blocks in pieces.items():
        result = pair.receiver.wait(transfer_id, 10)
        assert result.status == TransferStatus.DONE
        assert torch.equal(pair.dst_cache[:, result.dst_block_ids].view(torch.uint8), src[:, blocks].view(torch.uint8))
        pair.pool.free(result.dst_block_ids)
    assert_no_leak(pair.pool, [])
    assert_both_sides_clean(pair)


def test_codec_none_moves_cells_without_a_copy(make_pair, layout, monkeypatch):
    """Cache to cache: no codec gather on the sender, no staged decode on the receiver, no staging area."""
    from kv_transfer.codec import NoneCodec

    def refuse(*args, **kwargs):
        raise AssertionError("the codec ran: a gathered or staged copy was made")

    monkeypatch.setattr(NoneCodec, "encode_from", refuse)
    monkeypatch.setattr(NoneCodec, "decode_into", refuse)
    pair = nixl_pair(make_pair, layout, chunk_bytes=200)
    src = random_cache(layout, 8, seed=5)
    handle = pair.sender.send(KVPiece("r", src, [7, 2, 3, 0, 6]), pair.dest)
    assert handle.wait(30) == TransferStatus.DONE, handle
    result = pair.receiver.wait(handle.transfer_id, 10)
    assert torch.equal(pair.dst_cache[:, result.dst_block_ids], src[:, [7, 2, 3, 0, 6]])
    assert pair.sender.staging is None and pair.receiver.staging is None


@pytest.mark.parametrize("codec", ["fp8", "int8"])
@pytest.mark.parametrize("mode", MODES)
def test_lossy_codecs_decode_as_the_tcp_transport_does(make_pair, codec, mode):
    layout = KVLayout(2, 2, 16, 64, torch.bfloat16, "m")
    src = random_cache(layout, 6, seed=7)
    ids = [4, 1, 5]
    nixl, tcp = nixl_pair(make_pair, layout, mode, codec, chunk_bytes=2000), make_pair("tcp", layout, codec=codec)
    decoded = []
    for pair in (nixl, tcp):
        handle = pair.sender.send(KVPiece("r", src, ids), pair.dest)
        assert handle.wait(30) == TransferStatus.DONE, handle
        result = pair.receiver.wait(handle.transfer_id, 10)
        decoded.append(pair.dst_cache[:, result.dst_block_ids].clone())
        assert handle.wire_bytes < 0.6 * src[:, ids].numel() * 2
        pair.pool.free(result.dst_block_ids)
    assert torch.equal(decoded[0].view(torch.uint8), decoded[1].view(torch.uint8))
    assert_both_sides_clean(nixl)


@pytest.mark.parametrize("mode", MODES)
def test_a_piece_larger_than_the_staging_areas_cycles_their_slots(make_pair, layout, mode):
    """fp8 chunks take staging slots on both ends; a piece of many times their size still goes through."""
    pair = nixl_pair(make_pair, layout, mode, codec="fp8", chunk_bytes=1000, staging_bytes=2048,
                     receiver_options={"staging_bytes": 2048})
    src = random_cache(layout, 10, seed=6)
    ids = [9, 3, 0, 7, 1, 4, 8, 2]
    handle = pair.sender.send(KVPiece("r", src, ids), pair.dest)
    assert handle.wait(30) == TransferStatus.DONE, handle
    assert handle.wire_bytes > 2048                         # more than either staging area holds
    result = pair.receiver.wait(handle.transfer_id, 10)
    expected = src.clone()
    from kv_transfer import get_codec

    get_codec("fp8").roundtrip(expected, torch.tensor(ids))
    assert torch.equal(pair.dst_cache[:, result.dst_block_ids].view(torch.uint8), expected[:, ids].view(torch.uint8))
    assert_both_sides_clean(pair)


@pytest.mark.parametrize("mode", MODES)
def test_every_ending_frees_both_sides(make_pair, layout, mode, monkeypatch):
    pair = nixl_pair(make_pair, layout, mode, codec="fp8", chunk_bytes=200)
    pair.sender.handshake(pair.dest)  # the set-up must not eat the short deadline on a busy machine
    src = random_cache(layout, 6)
    # DONE: the decode worker owns the blocks, then frees them
    done = pair.sender.send(KVPiece("r", src, [1, 2, 3]), pair.dest)
    assert done.wait(30) == TransferStatus.DONE, done
    pair.pool.free(pair.receiver.wait(done.transfer_id, 5).dst_block_ids)
    # EXPIRED: one layer arrives, the others never do
    part = pair.sender.send(KVPiece("r", src, [1, 2, 3], transfer_id="x", layers=(0, 1), deadline_s=1.0), pair.dest)
    assert part.wait(30) == TransferStatus.DONE and pair.pool.num_used == 3
    expired = pair.receiver.wait("x", 10)
    assert expired.status == TransferStatus.EXPIRED and "deadline" in expired.error
    # CANCELLED: the decode worker drops the request mid-transfer
    part = pair.sender.send(KVPiece("r", src, [4, 5], transfer_id="c", layers=(1, 2)), pair.dest)
    assert part.wait(30) == TransferStatus.DONE
    assert pair.receiver.cancel(transfer_id="c") == ["c"]
    assert pair.receiver.wait("c", 5).status == TransferStatus.CANCELLED
    late = pair.sender.send(KVPiece("r", src, [4, 5], transfer_id="c", layers=(0, 1)), pair.dest)
    assert late.wait(30) == TransferStatus.FAILED and late.failed_side == FailedSide.RECEIVER
    # FAILED: a chunk whose bytes do not match its checksum
    real = nixl_sender.host_checksum
    monkeypatch.setattr(nixl_sender, "host_checksum", lambda payload: real(payload) ^ 1)
    bad = pair.sender.send(KVPiece("r", src, [1, 2]), pair.dest)
    assert bad.wait(30) == TransferStatus.FAILED and "checksum mismatch" in bad.error
    assert pair.receiver.wait(bad.transfer_id, 5).status == TransferStatus.FAILED
    assert_both_sides_clean(pair)
    assert_no_leak(pair.pool)


@pytest.mark.parametrize("mode", MODES)
def test_a_corrupted_chunk_fails_on_its_checksum_and_frees_its_blocks(make_pair, layout, mode, monkeypatch):
    real, calls = nixl_sender.cells_checksum, []

    def corrupt(*args):                  # the second chunk's bytes no longer match what its header says
        calls.append(True)
        return real(*args) ^ (1 if len(calls) == 2 else 0)

    monkeypatch.setattr(nixl_sender, "cells_checksum", corrupt)
    pair = nixl_pair(make_pair, layout, mode, chunk_bytes=200)
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 5), [0, 1, 2, 3]), pair.dest)
    assert handle.wait(30) == TransferStatus.FAILED
    assert handle.failed_side == FailedSide.RECEIVER and "checksum mismatch in chunk 1" in handle.error
    result = pair.receiver.wait(handle.transfer_id, 5)
    assert result.status == TransferStatus.FAILED and "checksum" in result.error and result.dst_block_ids == []
    assert_both_sides_clean(pair)  # push: a block offered to a WRITE comes back once the sender's abort says so
    assert_no_leak(pair.pool)
    ok = pair.sender.send(KVPiece("r2", random_cache(layout, 5), [0, 1]), pair.dest)  # the link still works
    assert ok.wait(30) == TransferStatus.DONE, ok
    assert_no_leak(pair.pool, pair.receiver.wait(ok.transfer_id, 5).dst_block_ids)
    assert_both_sides_clean(pair)


@pytest.mark.parametrize("mode", MODES)
def test_nan_in_kv_fails_on_the_sender_side_and_the_link_goes_on(make_pair, layout, mode):
    pair = nixl_pair(make_pair, layout, mode, codec="fp8", chunk_bytes=200)
    src = random_cache(layout, 4)
    src[2, 3, 1, 0, 0, 0] = float("nan")  # last layer: earlier chunks were already shipped
    handle = pair.sender.send(KVPiece("r", src, [0, 1, 2, 3]), pair.dest)
    assert handle.wait(30) == TransferStatus.FAILED and handle.failed_side == FailedSide.SENDER
    assert "NaN" in handle.error
    assert pair.receiver.wait(handle.transfer_id, 5).status == TransferStatus.FAILED
    ok = pair.sender.send(KVPiece("r2", random_cache(layout, 4), [0, 1]), pair.dest)
    assert ok.wait(30) == TransferStatus.DONE, ok
    assert_both_sides_clean(pair)
    assert_no_leak(pair.pool, pair.receiver.wait(ok.transfer_id, 5).dst_block_ids)


def test_an_abort_after_every_shipped_chunk_landed_still_fails_the_transfer(make_pair, layout, monkeypatch):
    """Pull: the encode of the last chunk (the NaN) waits until every earlier chunk has been READ and checked;
    the abort then finds no chunk pending, and must still end the transfer on the receiver, freeing its
    blocks. (Push cannot be held this way: its WRITEs do not complete while the sending thread waits here.)"""
    real = kv_codec.Fp8BlockCodec.encode_from
    pair = nixl_pair(make_pair, layout, "pull", codec="fp8", chunk_bytes=200)

    def all_shipped_chunks_landed() -> bool:
        pieces = [piece for conn in list(pair.receiver._conns.values()) for piece in list(conn.pieces.values())]
        return bool(pieces) and all(piece.transfer_ids and not piece.pending for piece in pieces)

    def encode_last_after_the_rest_landed(self, kv_cache, layers, *args, **kwargs):
        if layers[0] == layout.num_layers - 1 and int(args[0][-1]) == 3:
            assert wait_for(all_shipped_chunks_landed, 10)
        return real(self, kv_cache, layers, *args, **kwargs)

    monkeypatch.setattr(kv_codec.Fp8BlockCodec, "encode_from", encode_last_after_the_rest_landed)
    src = random_cache(layout, 4)
    src[2, 3, 1, 0, 0, 0] = float("nan")
    handle = pair.sender.send(KVPiece("r", src, [0, 1, 2, 3]), pair.dest)
    assert handle.wait(30) == TransferStatus.FAILED and handle.failed_side == FailedSide.SENDER
    result = pair.receiver.wait(handle.transfer_id, 5)
    assert result is not None and result.status == TransferStatus.FAILED and "aborted" in result.error
    assert_both_sides_clean(pair)
    assert_no_leak(pair.pool)


def test_a_wrong_token_is_refused_before_any_address_travels(make_pair, layout):
    pair = nixl_pair(make_pair, layout, sender_token="not-the-token")
    handle = pair.sender.send(KVPiece("r", random_cache(layout, 3), [0, 1]), pair.dest)
    assert handle.wait(30) == TransferStatus.FAILED and handle.failed_side == FailedSide.RECEIVER
    assert "token" in handle.error and pair.receiver.stats.auth_failures == 1
    assert not bool(pair.dst_cache.any())
    assert_no_leak(pair.pool)


@pytest.mark.parametrize("mode", MODES)
def test_an_unauthenticated_peer_learns_no_address(make_pair, layout, mode):
    """A probe that cannot prove the secret gets a refusal without metadata or addresses, and is counted; a
    garbage hello is dropped and counted too."""
    pair = nixl_pair(make_pair, layout, mode)
    host, port = pair.dest.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as probe:
        recv_exact(probe, NONCE_BYTES)
        send_hello(probe, {"nonce": "ab" * 16, "layout": pair.sender.describe(), "mode": mode,
                           "agent": "intruder", "mac": "00" * 32})
        reply = recv_hello(probe)
    assert reply == {"ok": False, "error": "receiver rejected the cluster token"}
    assert pair.receiver.stats.auth_failures == 1
    with socket.create_connection((host, int(port)), timeout=5) as probe:
        recv_exact(probe, NONCE_BYTES)
        probe.sendall(b"\xff\xff\xff\x7f garbage")
        assert probe.recv(1) == b""                  # dropped without a reply
    assert wait_for(lambda: pair.receiver.stats.bad_hellos == 1)
    ok = pair.sender.send(KVPiece("r", random_cache(layout, 3), [0, 1]), pair.dest)
    assert ok.wait(30) == TransferStatus.DONE, ok


@pytest.mark.parametrize("mode", MODES)
def test_a_sender_reveals_nothing_to_a_receiver_that_cannot_prove_the_secret(layout, mode):
    """An impostor endpoint sees the sender's hello (no metadata, no address) and cannot fake an ok reply."""
    from kv_transfer import make_sender

    server = socket.create_server(("127.0.0.1", 0))
    sender = make_sender("nixl", layout, token=TOKEN, mode=mode)
    seen: list[dict] = []

    def impostor() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"n" * NONCE_BYTES)
            seen.append(recv_hello(conn))
            send_hello(conn, {"ok": True, "error": "", "layout": sender.describe(), "agent": "x", "mac": "00" * 32})
            conn.settimeout(5)
            seen.append({"after": conn.recv(1 << 16)})

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        handle = sender.send(KVPiece("r", random_cache(layout, 3), [0, 1]), f"127.0.0.1:{server.getsockname()[1]}")
        assert handle.wait(30) == TransferStatus.FAILED and "did not prove the cluster secret" in handle.error
        thread.join(10)
        hello, after = seen
        assert set(hello) == {"nonce", "layout", "mode", "agent", "mac"}  # no metadata, no region
        assert after == {"after": b""}                                     # and nothing after the bad reply
    finally:
        sender.close()
        server.close()


def test_a_forged_landed_notification_is_ignored_and_counted(make_pair, layout):
    """Push: a NIXL notification not made under the connection's channel key never completes a chunk."""
    pair = nixl_pair(make_pair, layout, "push")
    src = random_cache(layout, 3)
    assert pair.sender.send(KVPiece("r", src, [0, 1]), pair.dest).wait(30) == TransferStatus.DONE
    agent = pair.sender.agent._agent  # the raw NIXL agent: a peer that loaded the receiver's metadata
    agent.send_notif(pair.receiver.agent.name, landed_note(hello_key("another secret"), 2, 0))
    agent.send_notif(pair.receiver.agent.name, b"not a note")
    handle = pair.sender.send(KVPiece("r", src, [2]), pair.dest)   # the notes are read while it runs
    assert handle.wait(30) == TransferStatus.DONE, handle
    assert wait_for(lambda: pair.receiver.stats.auth_failures == 2, 5), pair.receiver.stats


def test_listeners_bind_loopback_only(make_pair, layout):
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to list listening sockets")
    pair = nixl_pair(make_pair, layout)
    assert pair.sender.send(KVPiece("r", random_cache(layout, 3), [0, 1]), pair.dest).wait(30) == TransferStatus.DONE
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    mine = [line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line]
    assert mine, out                        # the control listener and UCX's own
    # loopback only: 127.x, ::1, or an IPv6 socket bound to IPv4-mapped loopback (::ffff:127.x)
    assert all(address.startswith(("127.", "[::1]", "[::ffff:127.")) for address in mine), mine


def test_a_transfer_is_checked_by_one_thread_at_a_time_and_never_after_its_release():
    """NIXL's state check relinks the handle's own request list, unguarded: two threads at once corrupt it,
    and a check after release reads freed memory (both crashed receivers with several UCX workers)."""

    class Library:
        def __init__(self):
            self.inside, self.released, self.overlaps, self.after_release = set(), set(), 0, 0

        def check_xfer_state(self, handle):
            self.overlaps += handle in self.inside
            self.after_release += handle in self.released
            self.inside.add(handle)
            time.sleep(0.0005)          # the library's work, long enough for the other threads to try
            self.inside.discard(handle)
            return "DONE"

        def release_xfer_handle(self, handle):
            self.released.add(handle)

    library = Library()
    agent = object.__new__(nixl_agent.Agent)
    agent._agent = library
    xfer = nixl_agent.Transfer("handle")
    threads = [threading.Thread(target=lambda: [agent.state(xfer) for _ in range(40)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    agent.release(xfer)
    agent.release(xfer)
    assert agent.state(xfer) == "DONE"              # the state it was released in
    assert (library.overlaps, library.after_release, library.released) == (0, 0, {"handle"})


def test_environment_keeps_ucx_on_loopback_and_adds_cuda_copy():
    env = nixl_agent.ucx_environment("tcp,shm", "127.0.0.1", torch.device("cpu"))
    assert env["UCX_NET_DEVICES"] == "lo" and env["UCX_TLS"] == "tcp,shm" and env["NIXL_LOG_LEVEL"]
    assert nixl_agent.ucx_environment("rc", "localhost", torch.device("cuda"))["UCX_TLS"] == "rc,cuda_copy"
    assert nixl_agent.ucx_environment("rc,cuda_copy", "::1", torch.device("cuda"))["UCX_TLS"] == "rc,cuda_copy"
    assert nixl_agent.interface_of("127.0.0.1") == "lo"


def test_a_missing_library_names_the_package_to_install(monkeypatch):
    monkeypatch.setattr(nixl_agent, "MODULES", ("no_such_nixl._api",))
    with pytest.raises(nixl_agent.NixlUnavailable, match=r"pip install 'pdserve\[nixl\]'"):
        nixl_agent.load_api()


def test_config_errors_name_the_key():
    from deploy.config import ConfigError, load_config

    cfg = load_config(None, {"kv_transfer.transport": "nixl", "kv_transfer.nixl.mode": "push"})
    assert (cfg.kv_transfer.nixl.mode, cfg.kv_transfer.nixl.ucx_tls) == ("push", "tcp,shm")
    bad = {"kv_transfer.nixl.ucx_tls": "tcp;shm", "kv_transfer.nixl.mode": "pul", "kv_transfer.nixl.bakend": "UCX",
           "kv_transfer.nixl.staging_bytes": "1MiB", "kv_transfer.nixl.workers": 0}
    for key, value in bad.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, {"kv_transfer.transport": "nixl", key: value})
        assert str(err.value).startswith(f"{key}: "), str(err.value)


def test_notes_and_wire_helpers_round_trip():
    key = hello_key(TOKEN)
    assert parse_landed_note(key, landed_note(key, 7, 3)) == (7, 3)
    assert parse_landed_note(hello_key("other"), landed_note(key, 7, 3)) is None
    assert parse_landed_note(key, msgpack.packb([7, 3, b"x" * 32])) is None
    assert parse_landed_note(key, b"\xc1") is None
