"""TorchSender: the prefill side of the torch.distributed transport.

Builds a pair lazily per destination (answers the receiver's challenge
over its TCPStore, then a 2-rank group), keeps at most ``max_groups`` (LRU;
evicted pairs get a close message), posts each chunk's sends while the
previous chunk's complete, and reads the receiver's ack after the last
chunk. A pair that breaks is dropped (the next send builds a fresh one).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from kv_transfer.chunker import EncodedChunk
from kv_transfer.codec import CodecError
from kv_transfer.interface import FailedSide, TransferError, TransferStatus
from kv_transfer.layout import HandshakeError, check_compatible
from kv_transfer.sender import BaseSender
from kv_transfer.transports.torch.pair import (
    IDLE_TIMEOUT,
    KIND_ABORT,
    KIND_CHUNK,
    KIND_CLOSE,
    control_tensor,
    make_group,
    pair_prefix,
    rendezvous_key,
    rendezvous_proof,
    slot_key,
    split_host_port,
)
from kv_transfer.wire import unpack_small


class _Pair:
    def __init__(self, store, group, index: int) -> None:
        self.store, self.group, self.index = store, group, index
        self.lock = threading.Lock()


class TorchSender(BaseSender):
    def __init__(self, layout, *, device: str | torch.device = "cpu", max_groups: int = 8,
                 connect_timeout_s: float = 10.0, interface: str | None = None, **kwargs) -> None:
        # gloo and NCCL sends are asynchronous: the sending thread encodes chunk k+1 while chunk k is
        # on the wire, so chunks are encoded inline (no encoder-thread handoff per chunk)
        kwargs.setdefault("prefetch_depth", 0)
        super().__init__(layout, **kwargs)
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.max_groups, self.connect_timeout_s, self.interface = max_groups, connect_timeout_s, interface
        self._pairs: OrderedDict[str, _Pair] = OrderedDict()
        self._pairs_lock = threading.Lock()
        self._key = rendezvous_key(self.token)

    def _remote_handshake(self, dest: str, local: dict) -> dict:
        return self._pair(dest)[1]

    def _pair(self, dest: str) -> tuple[_Pair, dict]:
        with self._pairs_lock:
            pair = self._pairs.get(dest)
            if pair is not None:
                self._pairs.move_to_end(dest)
                return pair, {}
        host, port = split_host_port(dest)
        timeout = timedelta(seconds=self.connect_timeout_s)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        index, layout = self._rendezvous(store, timeout)
        group = make_group(dist.PrefixStore(pair_prefix(index), store), 0, self.backend, IDLE_TIMEOUT, host,
                           self.interface)
        pair = _Pair(store, group, index)
        with self._pairs_lock:
            self._pairs[dest] = pair
            evicted = [self._pairs.popitem(last=False)[1] for _ in range(len(self._pairs) - self.max_groups)]
        for old in evicted:
            self._close_pair(old)
        return pair, layout

    def _rendezvous(self, store, timeout: timedelta) -> tuple[int, dict]:
        """Claim a slot, answer its challenge, read the reply: -> (slot index, the receiver's layout).

        The hello carries an HMAC of the receiver's nonce for this slot, never the token.
        """
        index = store.add("pairs", 1) - 1
        challenge_key, hello_key, reply_key = (slot_key(kind, index) for kind in ("challenge", "hello", "reply"))
        store.wait([challenge_key], timeout)
        nonce = str(unpack_small(store.get(challenge_key)).get("nonce", ""))
        hello = {"proof": rendezvous_proof(self._key, index, nonce), "layout": self.describe(),
                 "backend": self.backend}
        store.set(hello_key, msgpack.packb(hello))
        try:
            store.wait([reply_key], timeout)
        except Exception:
            store.delete_key(hello_key)  # nobody answered: leave nothing behind
            raise
        reply = unpack_small(store.get(reply_key))
        store.delete_key(reply_key)
        if not reply.get("ok"):
            error = str(reply.get("error"))
            raise HandshakeError(error) if "mismatch" in error else TransferError(error, FailedSide.RECEIVER)
        layout = reply.get("layout") or {}
        check_compatible(self.describe(), layout)
        return index, layout

    def _close_pair(self, pair: _Pair) -> None:
        with pair.lock:
            try:
                pair.group.send([control_tensor(KIND_CLOSE, b"", 0, True, self.device)], 1, 0).wait()
            except Exception:
                pass

    def _drop(self, dest: str) -> None:
        with self._pairs_lock:
            self._pairs.pop(dest, None)
        self.forget(dest)

    @property
    def num_groups(self) -> int:
        with self._pairs_lock:
            return len(self._pairs)

    def _ship(self, dest: str, chunks: Iterator[EncodedChunk], deadline_at: float, transfer_id: str = "",
              sizes: list[int] | None = None) -> int:
        pair, _ = self._pair(dest)
        sizes = sizes or []
        wire_bytes, inflight, announced = 0, None, 0
        ack = torch.empty(2, dtype=torch.int64, device=self.device)
        with pair.lock:
            try:
                ack_work, encode_error = None, None
                try:
                    for index, chunk in enumerate(chunks):
                        if chunk.payload.numel() != sizes[index]:
                            raise RuntimeError(f"chunk {index} has {chunk.payload.numel()} bytes, "
                                               f"planned {sizes[index]}")
                        is_last = index == len(sizes) - 1
                        next_len = 0 if is_last else sizes[index + 1]
                        inflight = self._post(pair, chunk, is_last, next_len, inflight, deadline_at)
                        announced, wire_bytes = next_len, wire_bytes + inflight[2]
                        if is_last:  # posted right behind the last sends (not before: NCCL runs them in order)
                            ack_work = pair.group.recv([ack], 1, 0)
                except (CodecError, ValueError) as exc:
                    encode_error = exc
                if encode_error is not None:
                    # tell the receiver to free what it reserved; the payload the last control
                    # announced follows as filler, so the pair stays in step
                    inflight = self._finish_post(inflight, deadline_at)
                    messages = [control_tensor(KIND_ABORT, b"", 0, True, self.device)]
                    messages += [torch.zeros(announced, dtype=torch.uint8, device=self.device)] if announced else []
                    sends = [pair.group.send([message], 1, 0) for message in messages]
                    ack_work = pair.group.recv([ack], 1, 0)
                    for work in sends:
                        self._wait(work, deadline_at)
                self._finish_post(inflight, deadline_at)
                self._wait(ack_work, deadline_at)
                ok, error_len = (int(v) for v in ack.cpu())
                if not ok:
                    error = torch.empty(error_len, dtype=torch.uint8, device=self.device)
                    self._wait(pair.group.recv([error], 1, 0), deadline_at)
                    message = error.cpu().numpy().tobytes().decode(errors="replace")
                    if encode_error is None:
                        raise TransferError(message, FailedSide.RECEIVER)
                if encode_error is not None:
                    raise encode_error
            except (TransferError, HandshakeError, CodecError) as exc:
                if isinstance(exc, TransferError) and exc.side == FailedSide.TRANSPORT:
                    self._drop(dest)  # sends may still be pending: the pair is out of step
                raise
            except Exception as exc:
                self._drop(dest)
                raise TransferError(f"torch.distributed pair to {dest} broke: {str(exc)[:200]}",
                                    FailedSide.TRANSPORT) from None
        return wire_bytes

    def _post(self, pair: _Pair, chunk: EncodedChunk, is_last: bool, next_len: int, previous, deadline_at: float):
        """Post this chunk's two sends, then wait for the previous chunk's: two chunks in flight.

        ``next_len`` (the next chunk's payload size) lets the receiver post that
        payload's receive before it arrives: gloo holds a send until its receive
        is posted, so a late post costs a round trip per chunk.
        """
        payload = chunk.payload.to(self.device)
        control = control_tensor(KIND_CHUNK, chunk.header_bytes, payload.numel(), is_last, self.device, next_len)
        works = [pair.group.send([tensor], 1, 0) for tensor in (control, payload)]
        self._finish_post(previous, deadline_at)
        return works, (chunk, control, payload), control.numel() + payload.numel()

    def _finish_post(self, inflight, deadline_at: float) -> None:
        if inflight is None:
            return None
        works, keep, _ = inflight
        for work in works:
            self._wait(work, deadline_at)
        keep[0].release()  # tensors in ``keep`` stayed alive until their sends completed
        return None

    @staticmethod
    def _wait(work, deadline_at: float) -> None:
        remaining = deadline_at - time.monotonic()
        if remaining <= 0 or not work.wait(timedelta(seconds=remaining)):
            raise TransferError("send deadline passed on the torch pair", FailedSide.TRANSPORT, TransferStatus.EXPIRED)

    def close(self) -> None:
        super().close()
        with self._pairs_lock:
            pairs, self._pairs = list(self._pairs.values()), OrderedDict()
        for pair in pairs:
            self._close_pair(pair)
