"""tcp transport: one plain TCP connection per send() piece, sending from and receiving into the cache's rows.

    protocol.py  frames (CHUNK / END / ABORT, ACK), the challenge/response hello, scatter/gather socket I/O
    rows.py      a CPU cache's (layer, block) cells as byte runs, checksums over them
    sender.py    TcpSender (prefill side): connections per destination, frames from rows or encoded chunks
    receiver.py  TcpReceiver (decode side): listener, one thread per connection, writes into reserved blocks

The fastest path the machine has: under codec ``none`` a chunk leaves the
prefill cache through ``sendmsg`` of memoryviews of its cells and lands in
the decode cache's reserved cells through ``recvmsg_into``: no gathered copy,
no staging copy, no framing copy. Under ``fp8`` the compiled kernel encodes
the cells into a pooled buffer that is sent as it is, and the receiver
decodes from its pooled receive buffer straight into the cells.

Same contract as every transport: the wire header of ``kv_transfer.wire``
(checksum of every chunk, verified before the blocks are handed over; the
handoff bytes), the internal secret (proved per connection for a fresh
nonce, never sent), optional mutual TLS (``InternalTLS``: then ``sendall`` /
``recv_into`` per buffer, as TLS sockets take no scatter/gather), and a
failed, expired or broken transfer frees every block it reserved.
"""

from kv_transfer.transports.tcp.receiver import TcpReceiver
from kv_transfer.transports.tcp.sender import TcpSender

__all__ = ["TcpReceiver", "TcpSender"]
