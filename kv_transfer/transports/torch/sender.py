"""TorchSender: the prefill side of the torch.distributed transport.

Builds a pair lazily per destination (passes the receiver's rendezvous,
``rendezvous.dial``, then builds a 2-rank group over the pair's store, whose
calls travel on the rendezvous connection), keeps at most ``max_groups``
(LRU; evicted pairs get a close message, then their group and connection
close), posts each chunk's sends while the previous chunk's complete, and
reads the receiver's ack after the last chunk. A pair that breaks is dropped
(the next send builds a fresh one).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from datetime import timedelta

import torch

from kv_transfer.chunker import EncodedChunk
from kv_transfer.codec import CodecError
from kv_transfer.interface import FailedSide, TransferError, TransferStatus
from kv_transfer.layout import HandshakeError, check_compatible
from kv_transfer.sender import BaseSender
from kv_transfer.transports.torch.pair import (
    KIND_ABORT,
    KIND_CHUNK,
    KIND_CLOSE,
    TEARDOWN_TIMEOUT,
    control_tensor,
    destroy_group,
    make_group,
    split_host_port,
    wait_work,
)
from kv_transfer.transports.torch.rendezvous import dial, rendezvous_key
from kv_transfer.transports.torch.store import PairStore, RemoteSpace

# A wait bounded by the time left (`left()`) can give up a hair before the deadline by this clock:
# an error that close to it is the deadline's, not the peer's.
DEADLINE_SLACK_S = 0.05


class _Pair:
    def __init__(self, store: PairStore, group, index: int, layout: dict) -> None:
        self.store, self.group, self.index, self.layout = store, group, index, layout
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
        self._sending = threading.local()  # .deadline_at of the send this worker thread runs

    def _run(self, handle, dest: str, held: list, deadline_at: float) -> None:
        self._sending.deadline_at = deadline_at  # the handshake that builds a pair keeps to it
        try:
            super()._run(handle, dest, held, deadline_at)
        finally:
            self._sending.deadline_at = None

    def _remote_handshake(self, dest: str, local: dict) -> dict:
        return self._pair(dest, getattr(self._sending, "deadline_at", None))[1]

    def _pair(self, dest: str, deadline_at: float | None = None) -> tuple[_Pair, dict]:
        """The pair to ``dest``, built now if there is none: within ``connect_timeout_s`` and the
        transfer's deadline (``deadline_at``, time.monotonic()), whichever ends first."""
        with self._pairs_lock:
            pair = self._pairs.get(dest)
            if pair is not None:
                self._pairs.move_to_end(dest)
                return pair, pair.layout
        host, port = split_host_port(dest)
        start = time.monotonic()
        end = start + self.connect_timeout_s if deadline_at is None else min(start + self.connect_timeout_s,
                                                                              deadline_at)

        def left() -> timedelta:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no time left")
            return timedelta(seconds=remaining)

        space = None  # the pair's store calls travel on the rendezvous connection
        try:
            sock, reply = dial(host, port, self._key, {"layout": self.describe(), "backend": self.backend}, left)
            space = RemoteSpace(sock)
            index, layout = reply["index"], reply["layout"]
            check_compatible(self.describe(), layout)
            store = PairStore(space, left())
            group = make_group(store, 0, self.backend, left(), host, self.interface)
        except (TransferError, HandshakeError):
            _close_space(space)
            raise
        except Exception as exc:
            _close_space(space)
            if time.monotonic() < end - DEADLINE_SLACK_S:
                raise  # refused or broken before the time was up: the error says it
            by_deadline = deadline_at is not None and deadline_at <= start + self.connect_timeout_s
            limit = "the transfer deadline" if by_deadline else "connect_timeout_s"
            raise TransferError(f"torch pair set-up with {dest} did not finish within {limit} "
                                f"({end - start:.1f} s): {str(exc)[:200]}", FailedSide.TRANSPORT,
                                TransferStatus.EXPIRED if by_deadline else TransferStatus.FAILED) from None
        pair = _Pair(store, group, index, layout)
        with self._pairs_lock:
            self._pairs[dest] = pair
            evicted = [self._pairs.popitem(last=False)[1] for _ in range(len(self._pairs) - self.max_groups)]
        for old in evicted:
            self._close_pair(old)
        return pair, layout

    def _close_pair(self, pair: _Pair) -> None:
        """Say close (bounded by TEARDOWN_TIMEOUT: the receiver may be gone or hung), then destroy the group."""
        with pair.lock:
            if pair.group is not None:
                with contextlib.suppress(Exception):
                    close = control_tensor(KIND_CLOSE, b"", 0, True, self.device)
                    wait_work(pair.group.send([close], 1, 0), TEARDOWN_TIMEOUT)
            self._destroy(pair)

    @staticmethod
    def _destroy(pair: _Pair) -> None:
        """Caller holds ``pair.lock``. Closing the store's connection drops the pair's keys on the receiver."""
        destroy_group(pair.group)
        _close_space(pair.store.space if pair.store is not None else None)
        pair.group = pair.store = None

    def _drop(self, dest: str, pair: _Pair) -> None:
        """A broken pair: forget it and destroy its group. Caller holds ``pair.lock``."""
        with self._pairs_lock:
            if self._pairs.get(dest) is pair:
                del self._pairs[dest]
        self.forget(dest)
        self._destroy(pair)

    @property
    def num_groups(self) -> int:
        with self._pairs_lock:
            return len(self._pairs)

    def _ship(self, dest: str, chunks: Iterator[EncodedChunk], deadline_at: float, transfer_id: str = "",
              sizes: list[int] | None = None) -> int:
        pair, _ = self._pair(dest, deadline_at)
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
                    self._drop(dest, pair)  # sends may still be pending: the pair is out of step
                raise
            except Exception as exc:
                self._drop(dest, pair)
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


def _close_space(space: RemoteSpace | None) -> None:
    if space is not None:
        space.close()
