"""torch.distributed transport: one 2-rank process group per prefill–decode pair.

    pair.py      the pair protocol's constants, control slots and group construction
    sender.py    TorchSender (prefill side): builds pairs, posts chunks, reads acks
    receiver.py  TorchReceiver (decode side): hosts the store, serves each pair on a thread

The decode side hosts a TCPStore at its endpoint. No secret is ever stored
in it: any client of the store can read every key. A sender meeting a new
destination:
    1. connects to the store and claims a slot n = add("pairs", 1) - 1,
    2. reads challenge/n = msgpack {nonce} (the receiver writes a fresh
       random nonce for every slot it sees claimed),
    3. writes hello/n = msgpack {proof, layout description, backend} where
       proof = HMAC-SHA256(key, "hello|n|nonce") and
       key = HMAC-SHA256(token, "pdserve-kv-rendezvous-v1"),
    4. the receiver's accept loop checks the proof (counted on failure) and
       the layout, writes reply/n = msgpack {ok, error, layout}; the sender
       reads and deletes it,
    5. both build a ProcessGroup (rank 0 = sender, rank 1 = receiver) over
       PrefixStore("pair/n/"): NCCL when the caches are CUDA, gloo on CPU.
The accept loop serves every open slot at once: a slot claimed by a client
that never says hello (or a sender killed between its steps) is skipped
after ``hello_timeout_s`` and its keys deleted; it delays no other slot.
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
