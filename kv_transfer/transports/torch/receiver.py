"""TorchReceiver: the decode side of the torch.distributed transport.

Hosts the TCPStore at its endpoint, challenges each claimed pair slot and
answers its hello (proof of the token, layout, backend), skips slots that
stay silent, and serves each accepted pair on its own thread: chunks are received into
pooled buffers and decoded on a small pool while the next one arrives; the
last chunk of each send() is acked. A broken pair fails its in-flight
transfers (their blocks are freed) and its thread ends.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from kv_transfer.buffers import payload_pool
from kv_transfer.interface import FailedSide, TransferError
from kv_transfer.layout import HandshakeError
from kv_transfer.receiver import BaseReceiver
from kv_transfer.transports.torch.pair import (
    CONTROL_BYTES,
    IDLE_TIMEOUT,
    KIND_ABORT,
    KIND_CLOSE,
    HELLO_TIMEOUT_S,
    MAX_OPEN_SLOTS,
    MAX_PENDING_DECODES,
    NONCE_BYTES,
    TEARDOWN_TIMEOUT,
    destroy_group,
    make_group,
    pair_prefix,
    parse_control,
    rendezvous_key,
    rendezvous_proof,
    slot_key,
    wait_work,
)
from kv_transfer.wire import MAX_HEADER_BYTES, WireError, unpack_header, unpack_small

ACCEPT_POLL_S = 0.02  # how often the accept loop looks for new claims and hellos


class TorchReceiver(BaseReceiver):
    def __init__(self, layout, kv_cache, allocator, *, host: str = "127.0.0.1", port: int = 0, max_groups: int = 64,
                 interface: str | None = None, decode_threads: int = 2, hello_timeout_s: float = HELLO_TIMEOUT_S,
                 **kwargs):
        super().__init__(layout, kv_cache, allocator, **kwargs)
        self.device = kv_cache.device
        self.backend = "nccl" if kv_cache.is_cuda else "gloo"
        self._op_timeout = None if self.backend == "nccl" else IDLE_TIMEOUT  # see pair.wait_work
        self.max_groups, self.interface, self.hello_timeout_s = max_groups, interface, hello_timeout_s
        self.host = host
        # TCPStore alone listens on every interface; hand it a socket bound to `host` only.
        listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                        backlog=128)
        self._port = listener.getsockname()[1]
        self._store = dist.TCPStore(host, self._port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=30), master_listen_fd=listener.fileno(),
                                    use_libuv=True)
        listener.detach()                # the store owns the descriptor now
        self._endpoint = f"{host}:{self._port}"
        self._key = rendezvous_key(self.token)
        self._closed = threading.Event()
        self._decoders = ThreadPoolExecutor(max_workers=decode_threads, thread_name_prefix="kv-torch-decode")
        # pairs by slot index, each entry removed when its pair ends: its thread (from the accepted
        # hello on), its group (once built)
        self._pair_threads: dict[int, threading.Thread] = {}
        self._groups: dict[int, object] = {}
        self._lock = threading.Lock()
        # accept-loop state: slot index -> (nonce, hello deadline); reply index -> when an unread reply is deleted
        self._slots: dict[int, tuple[str, float]] = {}
        self._replies: dict[int, float] = {}
        self._next_slot = 0
        threading.Thread(target=self._accept_loop, name="kv-torch-accept", daemon=True).start()

    # --- rendezvous ---------------------------------------------------------
    def _accept_loop(self) -> None:
        """Challenge each claimed slot, answer the hellos that come, skip the slots that stay silent."""
        while not self._closed.wait(ACCEPT_POLL_S):
            try:
                self._open_slots()
                for index in list(self._slots):
                    self._poll_slot(index)
                self._expire_replies()
            except Exception:  # store shutting down
                continue

    def _open_slots(self) -> None:
        claimed = self._store.add("pairs", 0)
        for index in range(max(self._next_slot, claimed - MAX_OPEN_SLOTS), claimed):
            nonce = secrets.token_hex(NONCE_BYTES)
            self._store.set(slot_key("challenge", index), msgpack.packb({"nonce": nonce}))
            self._slots[index] = (nonce, time.monotonic() + self.hello_timeout_s)
        self._next_slot = max(self._next_slot, claimed)
        while len(self._slots) > MAX_OPEN_SLOTS:
            self._close_slot(min(self._slots))

    def _poll_slot(self, index: int) -> None:
        nonce, hello_deadline = self._slots[index]
        hello_key = slot_key("hello", index)
        if self._store.check([hello_key]):
            hello = self._store.get(hello_key)
            self._close_slot(index)
            self._answer(index, hello, nonce)
        elif time.monotonic() > hello_deadline:  # claimed, then silent (or killed): later slots go on
            self._close_slot(index)

    def _close_slot(self, index: int) -> None:
        del self._slots[index]
        for kind in ("challenge", "hello"):
            self._store.delete_key(slot_key(kind, index))

    def _expire_replies(self) -> None:
        """Forget replies their sender read (it deletes them); delete the ones nobody read in time."""
        for index, expires_at in list(self._replies.items()):
            key = slot_key("reply", index)
            if not self._store.check([key]):
                del self._replies[index]
            elif time.monotonic() > expires_at:
                self._store.delete_key(key)
                del self._replies[index]

    def _answer(self, index: int, hello: bytes, nonce: str) -> None:
        reply = {"ok": False, "error": "", "layout": self.describe()}
        try:
            message = unpack_small(hello)
            if not self.check_token(message.get("proof"), rendezvous_proof(self._key, index, nonce)):
                raise TransferError("receiver rejected the cluster token", FailedSide.RECEIVER)
            self.check_handshake(message.get("layout") or {})
            if message.get("backend") != self.backend:
                raise HandshakeError(f"KV handshake mismatch on backend: sender={message.get('backend')!r} "
                                     f"receiver={self.backend!r}")
            with self._lock:
                if len(self._pair_threads) >= self.max_groups:
                    raise TransferError(f"receiver has {len(self._pair_threads)} peer groups (max {self.max_groups})",
                                        FailedSide.RECEIVER)
                self._pair_threads[index] = threading.Thread(target=self._serve_pair, args=(index,),
                                                             name=f"kv-torch-pair-{index}", daemon=True)
            reply["ok"] = True
        except Exception as exc:
            reply["error"] = str(exc)
        self._store.set(slot_key("reply", index), msgpack.packb(reply))
        self._replies[index] = time.monotonic() + self.hello_timeout_s
        if reply["ok"]:
            self._pair_threads[index].start()

    # --- one pair -----------------------------------------------------------
    def _serve_pair(self, index: int) -> None:
        in_flight: set[str] = set()
        group = None
        try:
            # Set-up is bounded by this receiver's transfer deadline: a sender that read its reply and
            # never joins costs that long, then frees its group slot. A store client of its own, so a
            # group waiting for its peer in the store does not hold up the accept loop's calls.
            setup = timedelta(seconds=self.default_timeout_s)
            client = dist.TCPStore(self.host, self._port, is_master=False, timeout=setup)
            group = make_group(dist.PrefixStore(pair_prefix(index), client), 1, self.backend, setup, self.host,
                               self.interface)
            with self._lock:
                self._groups[index] = group
            self._serve(group, in_flight, index)
        except Exception as exc:  # peer died, never joined, or the pair broke
            for transfer_id in in_flight:
                self.fail(transfer_id, f"sender connection lost: {str(exc)[:200]}")
        finally:
            with self._lock:
                self._groups.pop(index, None)
                self._pair_threads.pop(index, None)
            destroy_group(group)
            self._delete_pair_keys(index)

    def _delete_pair_keys(self, index: int) -> None:
        """The keys the pair's group set up with (its peers are connected, or gone) and an unread reply."""
        with contextlib.suppress(Exception):  # the store is closing
            self._store.delete_key(slot_key("reply", index))
            list_keys = getattr(self._store, "list_keys", None)  # torch from late 2025; older leaves pair/n/
            for key in list_keys() if list_keys is not None else ():
                if key.startswith(pair_prefix(index)):
                    self._store.delete_key(key)

    @property
    def num_groups(self) -> int:
        with self._lock:
            return len(self._pair_threads)

    def _post_control(self, group):
        slot = torch.empty(CONTROL_BYTES, dtype=torch.uint8, device=self.device)
        return slot, group.recv([slot], 0, 0)

    def _post_payload(self, group, nbytes: int):
        if not (0 <= nbytes <= self.max_payload):
            raise WireError(f"payload of {nbytes} bytes exceeds {self.max_payload}")
        payload = payload_pool.acquire(nbytes, self.device)
        return payload, group.recv([payload], 0, 0)

    def _serve(self, group, in_flight: set[str], index: int) -> None:
        """Receive chunks; ack the last chunk of each send(); return on a close message.

        Receives are posted ahead of the data (gloo holds a send until its
        receive is posted): within a send(), the next control slot and, as soon
        as a control announces it, the next chunk's payload. The next send()'s
        control slot is posted only after the ack: NCCL runs a pair's
        operations in order, so a receive posted first would hold the ack
        back. Chunks are decoded on a small pool while the next one arrives.
        """
        errors: list[str] = []
        pending: deque[Future] = deque()
        slot, work = self._post_control(group)
        ahead = None  # (buffer, work): the next payload, posted when the previous control announced it
        keys_left = True
        while not self._closed.is_set():
            wait_work(work, self._op_timeout)
            if keys_left:  # a first message: both ends are connected, the set-up keys are spent
                self._delete_pair_keys(index)
                keys_left = False
            kind, header_bytes, payload_len, is_last, next_len = parse_control(slot)  # WireError: drop the pair
            if kind == KIND_CLOSE:
                return
            if kind == KIND_ABORT:  # the sender failed to encode: the piece ends here
                is_last = True
                if ahead is not None:  # the announced payload arrives as filler
                    wait_work(ahead[1], self._op_timeout)
                    payload_pool.release(ahead[0])
                    ahead = None
                self._drain(pending, errors, 0)
                for transfer_id in in_flight:
                    self.fail(transfer_id, "sender aborted mid-transfer")
                errors.append("sender aborted")
            else:
                payload, payload_work = ahead if ahead is not None else self._post_payload(group, payload_len)
                if payload.numel() != payload_len:
                    raise WireError(f"chunk of {payload_len} bytes, its previous control announced {payload.numel()}")
                ahead = None
                if not is_last:
                    slot, work = self._post_control(group)
                    ahead = self._post_payload(group, next_len) if next_len else None
                wait_work(payload_work, self._op_timeout)
                self._take(header_bytes, payload, payload_len, pending, errors, in_flight)
            if is_last:
                self._drain(pending, errors, 0)
                data = (errors[0] if errors else "").encode()[:MAX_HEADER_BYTES]
                ack = torch.tensor([0 if data else 1, len(data)], dtype=torch.int64, device=self.device)
                wait_work(group.send([ack], 0, 0), self._op_timeout)
                if data:
                    error = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
                    wait_work(group.send([error], 0, 0), self._op_timeout)
                errors.clear()
                in_flight.clear()
                slot, work = self._post_control(group)

    def _take(self, header_bytes: bytes, payload, payload_len: int, pending: deque, errors: list[str],
              in_flight: set[str]) -> None:
        if errors:  # the piece already failed: drain its chunks
            payload_pool.release(payload)
            return
        try:
            header = unpack_header(header_bytes)
            in_flight.add(header.transfer_id)
            if header.payload_len != payload_len:
                self.fail(header.transfer_id, "payload length differs from its header")
                raise WireError(f"payload of {payload_len} bytes, header says {header.payload_len}")
            pending.append(self._decoders.submit(self._accept_pooled, header, payload))
        except (TransferError, WireError) as exc:
            payload_pool.release(payload)
            errors.append(str(exc))
        self._drain(pending, errors, MAX_PENDING_DECODES)

    def _accept_pooled(self, header, payload: torch.Tensor) -> None:
        """``accept`` a chunk received into a pooled buffer, then give the buffer back."""
        try:
            self.accept(header, payload)
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
        # (a thread still blocked in recv at interpreter exit takes gloo down with it), then
        # destroy the groups left (NCCL wakes their threads; gloo's go when their sender does).
        end = time.monotonic() + TEARDOWN_TIMEOUT.total_seconds()
        with self._lock:
            threads = list(self._pair_threads.values())
        for thread in threads:
            if thread.is_alive():
                thread.join(timeout=max(0.0, end - time.monotonic()))
        with self._lock:
            groups = list(self._groups.values())
        for group in groups:
            destroy_group(group)
        self._decoders.shutdown(wait=False)
        super().close()
