"""Helper process for the fault tests: start a transfer, then hang until killed.

    python kv_killed_sender.py grpc|tcp|torch DEST TOKEN [TRANSFER_ID]

Sends the first chunk of transfer TRANSFER_ID (default "killed", request "victim"), prints SENT,
and blocks with the stream / process group still open.
"""

from __future__ import annotations

import os
import sys
import threading
import time

os.environ["GLOO_SOCKET_IFNAME"] = "lo"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402

from kv_transfer import KVLayout, KVPiece, get_codec  # noqa: E402
from kv_transfer.chunker import encode_chunks  # noqa: E402

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32,
                  model_fingerprint="tiny-test")


def first_chunk(transfer_id: str):
    cache = torch.randn(LAYOUT.cache_shape(4))
    chunks = encode_chunks(
        KVPiece("victim", cache, [0, 1, 2], transfer_id=transfer_id, layers=(0, 3)), LAYOUT, get_codec("none"),
        deadline_at=time.monotonic() + 120, chunk_bytes=200,
    )
    return next(chunks)


def main() -> None:
    kind, dest, token = sys.argv[1:4]
    chunk = first_chunk(sys.argv[4] if len(sys.argv) > 4 else "killed")
    if kind == "grpc":
        import grpc

        from kv_transfer.transports.grpc import SERVICE
        from kv_transfer.wire import TOKEN_KEY, pack_frame

        def frames():
            yield pack_frame(chunk.header_bytes, chunk.payload.numpy())
            print("SENT", flush=True)
            threading.Event().wait()  # the stream stays open until we are killed

        channel = grpc.insecure_channel(dest)
        channel.stream_unary(f"/{SERVICE}/PushKV")(frames(), metadata=((TOKEN_KEY, token),))
    elif kind == "tcp":
        from kv_transfer.transports.tcp import TcpSender
        from kv_transfer.transports.tcp.protocol import FRAME, KIND_CHUNK, send_buffers

        sock, _ = TcpSender(LAYOUT, token=token)._connect(dest)
        send_buffers(sock, [FRAME.pack(KIND_CHUNK, len(chunk.header_bytes), chunk.payload.numel()),
                            chunk.header_bytes, chunk.payload.numpy()])
        print("SENT", flush=True)
        threading.Event().wait()  # the connection stays open until we are killed
    else:
        from kv_transfer.transports.torch import TorchSender

        sender = TorchSender(LAYOUT, token=token)
        pair, _ = sender._pair(dest)
        sender._finish_post(sender._post(pair, chunk, False, 0, None, time.monotonic() + 60), time.monotonic() + 60)
        print("SENT", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
