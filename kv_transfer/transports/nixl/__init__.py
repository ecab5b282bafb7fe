"""nixl transport: one-sided transfers between registered cache regions (NIXL over UCX), as vLLM's NixlConnector.

    agent.py     the library (``pip install 'pdserve[nixl]'``), the UCX environment, registration, READ / WRITE
    cells.py     cache cells as paired NIXL descriptors; checksums over cells
    staging.py   the registered staging area fp8 / int8 chunks are encoded into and read into
    protocol.py  the control connection: mutual hello (metadata exchange), MACed messages and notifications
    sender.py    NixlSender (prefill side): registers its cache once, describes or stages chunks, one control
                 connection per destination
    receiver.py  NixlReceiver (decode side): registers its cache once, reserves blocks, READs (pull) or offers
                 them to the sender's WRITEs (push), checks every landed chunk, holds back blocks a posted
                 READ may still fill

Each end registers its whole cache tensor (host memory on CPU, device memory on CUDA) with NIXL once; per
transfer the decode side reserves blocks as every transport does and the bytes move one-sided, cache cells to
cache cells, by descriptors (codec none, or a quantized cache's cells as stored), or encoded into a registered
staging slot and decoded from one (fp8 / int8). A head view of a cache (a head copy between tensor-parallel
degrees) registers the whole cache and moves a few byte runs of each cell (``cells.py``).
``mode`` pull (default): the decode side READs what the prefill side describes; push: the
prefill side WRITEs where the decode side says, with a notification. The control connection (plain TCP to
the receiver's endpoint, bound to its host) carries the metadata exchange, the per-chunk descriptors and
the acks; nothing on it, nor any notification, is taken unless it carries the internal secret's MAC.
Same contract as every transport: the wire header of ``kv_transfer.wire`` (checksum of every chunk, verified
before the blocks are handed over; the handoff), deadlines, and a failed, expired or cancelled transfer
frees every block it reserved on both sides.
"""

from kv_transfer.transports.nixl.receiver import NixlReceiver
from kv_transfer.transports.nixl.sender import NixlSender

__all__ = ["NixlReceiver", "NixlSender"]
