"""torch.distributed transport: one 2-rank process group per prefill–decode pair.

    pair.py         the pair protocol's constants, control slots and group construction
    rendezvous.py   the authenticated handshake that opens a pair (sender side: ``dial``)
    store.py        a pair's bounded key space and the torch.distributed Store over it
    sender.py       TorchSender (prefill side): builds pairs, posts chunks, reads acks
    receiver.py     TorchReceiver (decode side): the listener, each pair's key space and thread

The decode side listens at its endpoint (a socket bound to its host only) and
hosts no shared store: each pair gets a key space of its own, reachable only
over the connection that passed the rendezvous. A sender meeting a new
destination:
    1. connects; the receiver sends a fresh 16-byte nonce N_r,
    2. answers within one deadline for the whole exchange (``hello_timeout_s``)
       with msgpack {nonce N_s, proof, layout description, backend}, where
       proof = HMAC-SHA256(key, "hello", N_r, N_s) and
       key = HMAC-SHA256(token, "pdserve-kv-rendezvous-v2"),
    3. the receiver checks the proof (constant time, counted on failure), the
       layout and the backend, opens the pair (at most ``max_groups``) and
       replies {ok, error, layout, index, mac}, mac = HMAC-SHA256(key, "reply",
       N_r, N_s, the rest of the reply): the sender builds a group only on an
       ok reply whose mac holds (a refusal is believed as it stands: it makes
       the sender do nothing),
    4. the same connection then carries the pair's store calls (length-prefixed
       msgpack, one at a time) into its key space: at most 64 keys, 64 KiB a
       value, 256 KiB in all; a call over a bound fails the pair's set-up,
    5. both build a ProcessGroup (rank 0 = sender, rank 1 = receiver) over that
       key space (the receiver's rank reads it in process): NCCL when the
       caches are CUDA, gloo on CPU.
Connections still in their hello have 32 slots of their own (a new one drops
the oldest), so peers that never authenticate cannot keep a sender out; they
store nothing, and a malformed or late hello is counted (``bad_hellos``) and
logged as one WARNING a minute at most. The connection stays open while the
pair lives (NCCL reads the store at its first operation); the key space is
dropped when the pair ends, when its set-up fails, or when the sender closes
the connection during set-up. Unauthenticated state is bounded by the hello
slots (a hello is at most 4 KiB), authenticated by ``max_groups`` key spaces.
Each chunk is two point-to-point messages, metadata first:
    control uint8 [4096] (u32 kind, u32 header_len, u64 payload_len,
                          u32 is_last, u64 next_len, msgpack header at
                          offset 32) | payload
and after the last chunk of a send() the receiver answers
    ack int64 [2] (ok, error_len) | error bytes.
gloo holds a send until the peer has posted its receive, so receives are
posted ahead of the data: within a send(), the next control slot and the
next chunk's payload as soon as a control announces its size
(``next_len``); the sender's ack receive right behind its last chunk's
sends. NCCL runs a pair's operations in order, so neither side posts a
receive ahead of a send the other side is waiting for: the receiver posts
the next send()'s control slot only after its ack.
Control kinds: chunk, close (the sender evicts the pair), abort (the sender
failed mid-send: free what this piece reserved; the payload the previous
control announced follows as filler, keeping the pair in step).
Senders keep at most ``max_groups`` pairs (LRU; an evicted pair gets a
``close`` message). A broken pair (peer died) is torn down on both sides and
its in-flight transfers fail; the next send builds a fresh one.
"""

from kv_transfer.transports.torch.receiver import TorchReceiver
from kv_transfer.transports.torch.sender import TorchSender

__all__ = ["TorchReceiver", "TorchSender"]
