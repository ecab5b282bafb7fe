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

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from kv_transfer.base import FailedSide, TransferError, TransferStatus
from kv_transfer.buffers import payload_pool
from kv_transfer.chunker import EncodedChunk
from kv_transfer.codec import CodecError
from kv_transfer.layout import HandshakeError, check_compatible
from kv_transfer.receiver import CoreReceiver
from kv_transfer.sender_core import BaseSender
from kv_transfer.wire import MAX_HEADER_BYTES, WireError, unpack_header

KIND_CHUNK, KIND_CLOSE, KIND_ABORT = 1, 2, 3
MAX_PENDING_DECODES = 2  # received chunks waiting for decode, per pair
_IDLE_TIMEOUT = timedelta(days=1)  # an idle pair waits in recv; peer death still wakes it


def _split_host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise TransferError(f"bad torch endpoint {endpoint!r}; expected host:port", FailedSide.SENDER)
    return host, int(port)


def _make_group(store, rank: int, backend: str, timeout: timedelta, device_host: str, interface: str | None):
    prefix_store = dist.PrefixStore("pg/", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix_store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [_gloo_device(device_host, interface)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(prefix_store, rank, 2, options)


def _gloo_device(host: str, interface: str | None):
    """Loopback peers talk over 127.0.0.1; others over ``interface`` or GLOO_SOCKET_IFNAME."""
    interface = interface or (None if host.startswith("127.") or host == "localhost" else os.environ.get("GLOO_SOCKET_IFNAME"))
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    if host.startswith("127.") or host == "localhost":
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def _unpack_small(data: bytes) -> dict:
    if len(data) > MAX_HEADER_BYTES:
        raise WireError("handshake message too large")
    value = msgpack.unpackb(data, raw=False, max_str_len=4096, max_bin_len=0, max_array_len=0, max_map_len=64)
    if not isinstance(value, dict):
        raise WireError("handshake message is not a map")
    return value


class TorchReceiver(CoreReceiver):
    def __init__(self, layout, kv_cache, allocator, *, host: str = "127.0.0.1", port: int = 0, max_groups: int = 64, interface: str | None = None, decode_threads: int = 2, **kwargs):
        super().__init__(layout, kv_cache, allocator, **kwargs)
        self.device = kv_cache.device
        self.backend = "nccl" if kv_cache.is_cuda else "gloo"
        self.max_groups, self.interface = max_groups, interface
        self.host = host
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        self._endpoint = f"{host}:{self._store.port}"
        self._closed = threading.Event()
        self._decoders = ThreadPoolExecutor(max_workers=decode_threads, thread_name_prefix="kv-torch-decode")
        self._num_groups = 0
        self._pair_threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, name="kv-torch-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        index = 0
        while not self._closed.is_set():
            key = f"hello/{index}"
            try:
                if not self._store.check([key]):
                    self._closed.wait(0.02)
                    continue
                hello = self._store.get(key)
            except Exception:  # store shutting down
                self._closed.wait(0.1)
                continue
            self._store.delete_key(key)
            self._answer(index, hello)
            index += 1

    def _answer(self, index: int, hello: bytes) -> None:
        reply = {"ok": False, "error": "", "layout": self.core.describe()}
        try:
            message = _unpack_small(hello)
            if not self.core.check_token(message.get("token")):
                raise TransferError("receiver rejected the cluster token", FailedSide.RECEIVER)
            self.core.check_handshake(message.get("layout") or {})
            if message.get("backend") != self.backend:
                raise HandshakeError(f"KV handshake mismatch on backend: sender={message.get('backend')!r} receiver={self.backend!r}")
            with self._lock:
                if self._num_groups >= self.max_groups:
                    raise TransferError(f"receiver has {self._num_groups} peer groups (max {self.max_groups})", FailedSide.RECEIVER)
                self._num_groups += 1
            reply["ok"] = True
        except Exception as exc:
            reply["error"] = str(exc)
        self._store.set(f"reply/{index}", msgpack.packb(reply))
        if reply["ok"]:
            thread = threading.Thread(target=self._serve_pair, args=(index,), name=f"kv-torch-pair-{index}", daemon=True)
            self._pair_threads.append(thread)
            thread.start()

    def _serve_pair(self, index: int) -> None:
        in_flight: set[str] = set()
        try:
            group = _make_group(dist.PrefixStore(f"pair/{index}/", self._store), 1, self.backend, _IDLE_TIMEOUT, self.host, self.interface)
            while not self._closed.is_set():
                if not self._serve_piece(group, in_flight):
                    break
        except Exception as exc:  # peer died or the pair broke
            for transfer_id in in_flight:
                self.core.fail(transfer_id, f"sender connection lost: {str(exc)[:200]}")
        finally:
            with self._lock:
                self._num_groups -= 1

    def _serve_piece(self, group, in_flight: set[str]) -> bool:
        """Receive chunks up to and including the last one of a send(); ack it.

        Chunks are decoded on a small pool while the next one is received.
        """
        errors: list[str] = []
        pending: deque[Future] = deque()
        while True:
            meta = torch.empty(4, dtype=torch.int64, device=self.device)
            group.recv([meta], 0, 0).wait()
            kind, header_len, payload_len, is_last = (int(v) for v in meta.cpu())
            if kind == KIND_CLOSE:
                return False
            if kind == KIND_ABORT:  # the sender failed to encode: end the piece
                self._drain(pending, errors, 0)
                for transfer_id in in_flight:
                    self.core.fail(transfer_id, "sender aborted mid-transfer")
                errors.append("sender aborted")
                is_last = 1
            elif kind != KIND_CHUNK or not (0 < header_len <= MAX_HEADER_BYTES) or not (0 <= payload_len <= self.core.max_payload):
                raise WireError(f"bad chunk meta {kind, header_len, payload_len}")  # stream unusable: drop the pair
            else:
                header_buf = torch.empty(header_len, dtype=torch.uint8, device=self.device)
                group.recv([header_buf], 0, 0).wait()
                payload = payload_pool.acquire(payload_len, self.device)
                group.recv([payload], 0, 0).wait()
                if errors:
                    payload_pool.release(payload)
                else:
                    try:
                        header = unpack_header(header_buf.cpu().numpy().tobytes())
                        in_flight.add(header.transfer_id)
                        if header.payload_len != payload_len:
                            self.core.fail(header.transfer_id, "payload length differs from its header")
                            raise WireError(f"payload of {payload_len} bytes, header says {header.payload_len}")
                        pending.append(self._decoders.submit(self._accept, header, payload))
                    except (TransferError, WireError) as exc:
                        errors.append(str(exc))
                    self._drain(pending, errors, MAX_PENDING_DECODES)
            if is_last:
                self._drain(pending, errors, 0)
                data = (errors[0] if errors else "").encode()[:MAX_HEADER_BYTES]
                group.send([torch.tensor([0 if data else 1, len(data)], dtype=torch.int64, device=self.device)], 0, 0).wait()
                if data:
                    group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)], 0, 0).wait()
                in_flight.clear()
                return True

    def _accept(self, header, payload: torch.Tensor) -> None:
        try:
            self.core.accept(header, payload)
        finally:
            payload_pool.release(payload)

    @staticmethod
    def _drain(pending: deque, errors: list[str], keep: int) -> None:
        while len(pending) > keep or (pending and pending[0].done()):
            try:
                pending.popleft().result()
            except (TransferError, WireError) as exc:
                errors.append(str(exc))

    def close(self) -> None:
        self._closed.set()
        # A pair thread ends when its sender says close or dies; give closing senders a moment
        # (a thread still blocked in recv at interpreter exit takes gloo down with it).
        end = time.monotonic() + 2.0
        for thread in self._pair_threads:
            thread.join(timeout=max(0.0, end - time.monotonic()))
        self._decoders.shutdown(wait=False)
        super().close()


class _Pair:
    def __init__(self, store, group, index: int) -> None:
        self.store, self.group, self.index = store, group, index
        self.lock = threading.Lock()


class TorchSender(BaseSender):
    def __init__(self, layout, *, device: str | torch.device = "cpu", max_groups: int = 8, connect_timeout_s: float = 10.0, interface: str | None = None, **kwargs) -> None:
        super().__init__(layout, **kwargs)
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.max_groups, self.connect_timeout_s, self.interface = max_groups, connect_timeout_s, interface
        self._pairs: OrderedDict[str, _Pair] = OrderedDict()
        self._pairs_lock = threading.Lock()

    def _remote_handshake(self, dest: str, local: dict) -> dict:
        return self._pair(dest)[1]

    def _pair(self, dest: str) -> tuple[_Pair, dict]:
        with self._pairs_lock:
            pair = self._pairs.get(dest)
            if pair is not None:
                self._pairs.move_to_end(dest)
                return pair, {}
        host, port = _split_host_port(dest)
        timeout = timedelta(seconds=self.connect_timeout_s)
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        index = store.add("pairs", 1) - 1
        store.set(f"hello/{index}", msgpack.packb({"token": self.token, "layout": self.describe(), "backend": self.backend}))
        store.wait([f"reply/{index}"], timeout)
        reply = _unpack_small(store.get(f"reply/{index}"))
        store.delete_key(f"reply/{index}")
        if not reply.get("ok"):
            error = str(reply.get("error"))
            raise HandshakeError(error) if "mismatch" in error else TransferError(error, FailedSide.RECEIVER)
        check_compatible(self.describe(), reply.get("layout") or {})
        group = _make_group(dist.PrefixStore(f"pair/{index}/", store), 0, self.backend, _IDLE_TIMEOUT, host, self.interface)
        pair = _Pair(store, group, index)
        with self._pairs_lock:
            self._pairs[dest] = pair
            evicted = [self._pairs.popitem(last=False)[1] for _ in range(len(self._pairs) - self.max_groups)]
        for old in evicted:
            self._close_pair(old)
        return pair, reply.get("layout") or {}

    def _close_pair(self, pair: _Pair) -> None:
        with pair.lock:
            try:
                pair.group.send([torch.tensor([KIND_CLOSE, 0, 0, 1], dtype=torch.int64, device=self.device)], 1, 0).wait()
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

    def _ship(self, dest: str, chunks: Iterator[EncodedChunk], deadline_at: float, transfer_id: str = "") -> int:
        pair, _ = self._pair(dest)
        wire_bytes, inflight = 0, None
        with pair.lock:
            try:
                pending, encode_error = None, None
                try:
                    for chunk in chunks:  # one chunk behind, to flag the last one
                        if pending is not None:
                            inflight = self._post(pair, pending, False, inflight, deadline_at)
                            wire_bytes += inflight[2]
                        pending = chunk
                except (CodecError, ValueError) as exc:
                    encode_error = exc
                if encode_error is None:
                    inflight = self._post(pair, pending, True, inflight, deadline_at)
                    wire_bytes += inflight[2]
                else:  # tell the receiver to free what it reserved, keep the pair in sync
                    meta = torch.tensor([KIND_ABORT, 0, 0, 1], dtype=torch.int64, device=self.device)
                    inflight = self._finish_post(inflight, deadline_at)
                    self._wait(pair.group.send([meta], 1, 0), deadline_at)
                self._finish_post(inflight, deadline_at)
                ack = torch.empty(2, dtype=torch.int64, device=self.device)
                self._wait(pair.group.recv([ack], 1, 0), deadline_at)
                ok, error_len = (int(v) for v in ack.cpu())
                if not ok:
                    error = torch.empty(error_len, dtype=torch.uint8, device=self.device)
                    self._wait(pair.group.recv([error], 1, 0), deadline_at)
                    message = error.cpu().numpy().tobytes().decode(errors="replace")
                    if encode_error is None:
                        raise TransferError(message, FailedSide.RECEIVER)
                if encode_error is not None:
                    raise encode_error
            except (TransferError, HandshakeError, CodecError):
                raise
            except Exception as exc:
                self._drop(dest)
                raise TransferError(f"torch.distributed pair to {dest} broke: {str(exc)[:200]}", FailedSide.TRANSPORT) from None
        return wire_bytes

    def _post(self, pair: _Pair, chunk: EncodedChunk, is_last: bool, previous, deadline_at: float):
        """Post this chunk's three sends, then wait for the previous chunk's: two chunks in flight."""
        header = torch.frombuffer(bytearray(chunk.header_bytes), dtype=torch.uint8).to(self.device)
        payload = chunk.payload.to(self.device)
        meta = torch.tensor([KIND_CHUNK, header.numel(), payload.numel(), int(is_last)], dtype=torch.int64, device=self.device)
        works = [pair.group.send([tensor], 1, 0) for tensor in (meta, header, payload)]
        self._finish_post(previous, deadline_at)
        return works, (chunk, meta, header, payload), 32 + header.numel() + payload.numel()

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
