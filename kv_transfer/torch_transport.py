"""torch.distributed transport: one 2-rank process group per prefill–decode pair.

The decode side hosts a TCPStore at its endpoint ("host:port"). A sender
meeting a new destination:
    1. connects to the store, takes a pair index n = add("pairs", 1),
    2. writes hello/n = msgpack {token, layout description, backend},
    3. the receiver's accept thread checks the token (counted on failure)
       and the layout, and writes reply/n = msgpack {ok, error, layout},
    4. both build a ProcessGroup (rank 0 = sender, rank 1 = receiver) over
       PrefixStore("pg/n/"): NCCL when the caches are CUDA, gloo on CPU.
Each chunk is three point-to-point messages, header first:
    meta int64 [4] (kind, header_len, payload_len, is_last) | header | payload
and after the last chunk of a send() the receiver answers with
    ack int64 [2] (ok, error_len) | error bytes.
Senders keep at most ``max_groups`` pairs (LRU; an evicted pair gets a
``close`` message). A broken pair (peer died) is torn down on both sides and
its in-flight transfers fail; the next send builds a fresh one.
"""

from kv_transfer.torch_receiver import TorchReceiver
from kv_transfer.torch_sender import TorchSender

__all__ = ["TorchReceiver", "TorchSender"]
