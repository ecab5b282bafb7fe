"""One end of a transfer benchmark run, in its own process (or Ray actor).

    python -m bench.transfer.peer recv --transport grpc --codec fp8 --host 127.0.0.1 --token T
        prints "READY <endpoint>", serves until stdin closes; frees blocks on DONE
    python -m bench.transfer.peer send --transport grpc --codec fp8 --dest E --token T --payloads 1,16 --reps 3
        prints one JSON line per payload: {"payload_mib", "seconds", "wire_bytes"}
    (nixl, both roles: --nixl-mode pull|push --ucx-tls tcp,shm; the sender's --host picks its UCX interface)
    python -m bench.transfer.peer sock-recv --host H   /   sock-send --dest H:P --mib 128 --reps 3 [--plain]
        the raw TCP socket baseline between two processes (tuned, or the textbook loop)

``RecvPeer`` / ``SendPeer`` are plain classes so the Ray run can wrap them
as actors. The KV layout is fixed: 16 layers x 4 kv heads x 16 tokens x 64
dims, bfloat16 — 256 KiB per block over all layers.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import dataclasses
import time

import torch

from kv_transfer import KVLayout, KVPiece, SimpleBlockPool, TransferStatus, codec_compiled, make_receiver, make_sender
from kv_transfer.codec import cache_dtype_of, get_codec

LAYOUT = KVLayout(num_layers=16, num_kv_heads=4, block_size=16, head_dim=64, dtype=torch.bfloat16,
                  model_fingerprint="bench")
MIB = 1 << 20


def num_blocks_for(payload_mib: float) -> int:
    """Blocks of `payload_mib` MiB of bfloat16 KV (a quantized cache sends the same blocks, stored smaller)."""
    return max(1, int(payload_mib * MIB) // LAYOUT.block_nbytes)


def layout_for(codec: str) -> KVLayout:
    """The layout of the cache `codec` ships from: a quantized cache's for `fp8_cache` / `int8_cache`."""
    kind = cache_dtype_of(codec)
    return LAYOUT if kind == "auto" else dataclasses.replace(LAYOUT, cache_dtype=kind)


def random_cache(layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """Roughly unit-normal KV with a few outliers, like real keys and values (a quantized cache: those rows as
    it stores them)."""
    values = torch.randn(LAYOUT.cache_shape(num_blocks)).to(LAYOUT.dtype)
    if not layout.quantized:
        return values
    cells = torch.empty(layout.cache_shape(num_blocks), dtype=torch.uint8)
    get_codec(f"{layout.cache_dtype}_cache").encode(values, cells.view(-1))
    return cells


class RecvPeer:
    def __init__(self, transport: str, codec: str, host: str, token: str, max_mib: int = 128,
                 options: dict | None = None) -> None:
        num_blocks = num_blocks_for(max_mib) + 8
        layout = layout_for(codec)
        self.pool = SimpleBlockPool(num_blocks)
        self.cache = torch.zeros(layout.cache_shape(num_blocks), dtype=layout.storage_dtype)
        kwargs = {"host": host} if transport in ("grpc", "tcp", "torch", "nixl") else {}
        kwargs.update(options or {})
        self.receiver = make_receiver(transport, layout, self.cache, self.pool, self._done, codec=codec, token=token,
                                      **kwargs)
        codec_compiled.wait_ready()  # the receiver started its kernel build: measure the warm codec

    def _done(self, result) -> None:
        if result.status == TransferStatus.DONE:  # the "decode worker" is done with them at once
            self.pool.free(result.dst_block_ids)

    def endpoint(self) -> str:
        return self.receiver.endpoint

    def close(self) -> None:
        self.receiver.close()


class SendPeer:
    def __init__(self, transport: str, codec: str, token: str, options: dict | None = None) -> None:
        self.layout = layout_for(codec)
        self.sender = make_sender(transport, self.layout, codec=codec, token=token, max_workers=2, **(options or {}))

    def run(self, dest: str, payloads: list[float], reps: int) -> list[dict]:
        records = []
        for payload_mib in payloads:
            num_blocks = num_blocks_for(payload_mib)
            cache = random_cache(self.layout, num_blocks + 2)
            self.sender.codec.prepare(cache)
            codec_compiled.wait_ready()  # measure the codec a serving process runs once warm
            block_ids = list(range(1, num_blocks + 1))
            warm = self.sender.send(KVPiece("warm", cache, block_ids, deadline_s=120), dest)
            if warm.wait(120) != TransferStatus.DONE:
                raise RuntimeError(f"warm-up send failed: {warm}")
            times = []
            for rep in range(reps):
                handle = self.sender.send(KVPiece(f"r{rep}", cache, block_ids, deadline_s=120), dest)
                if handle.wait(120) != TransferStatus.DONE:
                    raise RuntimeError(f"send failed: {handle}")
                times.append(handle.elapsed_s)
            records.append({"payload_mib": payload_mib, "kv_bytes": num_blocks * LAYOUT.block_nbytes,
                            "seconds": min(times), "wire_bytes": handle.wire_bytes})
        return records

    def close(self) -> None:
        self.sender.close()


def sock_recv(host: str, plain: bool = False) -> None:
    """Tuned: 8 MiB kernel buffer, ``recv_into`` one reused buffer. Plain: the textbook loop,
    default buffers and ``recv(64 KiB)`` returning a new bytes object each call."""
    server = socket.create_server((host, 0))
    print(f"READY {host}:{server.getsockname()[1]}", flush=True)
    conn, _ = server.accept()
    if not plain:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MIB)
    buffer = memoryview(bytearray(4 * MIB))
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        (remaining,) = struct.unpack("<Q", head)
        while remaining:
            remaining -= len(conn.recv(min(remaining, 65536))) if plain else \
                conn.recv_into(buffer, min(remaining, len(buffer)))
        conn.sendall(b"k")


def sock_send(dest: str, mib: int, reps: int, plain: bool = False) -> float:
    host, port = dest.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)))
    if not plain:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * MIB)
    data, total = memoryview(bytearray(4 * MIB)), mib * MIB
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        conn.sendall(struct.pack("<Q", total))
        for _ in range(total // len(data)):
            conn.sendall(data)
        conn.recv(1)
        best = min(best, time.perf_counter() - start)
    conn.close()
    return total / best / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.transfer.peer")
    parser.add_argument("role", choices=["recv", "send", "sock-recv", "sock-send"])
    parser.add_argument("--transport", default="grpc")
    parser.add_argument("--codec", default="none")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--dest", default="")
    parser.add_argument("--token", default="bench-token")
    parser.add_argument("--payloads", default="1,16,128")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--plain", action="store_true", help="sock-*: the untuned textbook socket loop")
    parser.add_argument("--nixl-mode", default="pull", choices=["pull", "push"])
    parser.add_argument("--ucx-tls", default="tcp,shm")
    args = parser.parse_args(argv)
    options = {"mode": args.nixl_mode, "ucx_tls": args.ucx_tls} if args.transport == "nixl" else {}
    if args.role == "sock-recv":
        sock_recv(args.host, args.plain)
    elif args.role == "sock-send":
        print(json.dumps({"socket_gbps": sock_send(args.dest, args.mib, args.reps, args.plain)}), flush=True)
    elif args.role == "recv":
        max_mib = max(int(float(p)) for p in args.payloads.split(","))
        peer = RecvPeer(args.transport, args.codec, args.host, args.token, max_mib, options)
        print(f"READY {peer.endpoint()}", flush=True)
        sys.stdin.read()  # serve until the parent closes our stdin
        peer.close()
    else:
        peer = SendPeer(args.transport, args.codec, args.token, {**options, "host": args.host} if options else None)
        for record in peer.run(args.dest, [float(p) for p in args.payloads.split(",")], args.reps):
            print(json.dumps(record), flush=True)
        peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
