"""TorchReceiver: the decode side of the torch.distributed transport.

Listens at its endpoint (bound to ``host`` only). Each connection first passes the rendezvous
(``rendezvous.py``): one deadline, ``hello_timeout_s``, for the whole hello, in one of ``MAX_HELLOS``
slots of its own (``HelloSlots``: a new one drops the oldest, so silent peers never keep a sender
out); a malformed or late hello is counted in ``stats.bad_hellos``, a wrong proof in
``stats.auth_failures``, and neither stores anything. An accepted hello opens a pair (at most
``max_groups``): its own bounded key space (``store.KeySpace``), which the same connection serves to
the sender as a store while this side's rank reads it in process, and a thread that builds the
pair's group and serves it: chunks are received into pooled buffers and decoded on a small pool
while the next one arrives; the last chunk of each send() is acked. The connection stays open
while the pair lives (NCCL reads the store at its first operation); when the pair ends, or its
set-up fails, or the sender closes the connection during set-up, the key space is dropped. A
broken pair fails its in-flight transfers (their blocks are freed) and its thread ends.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch

from kv_transfer.buffers import payload_pool
from kv_transfer.interface import FailedSide, TransferError
from kv_transfer.layout import HandshakeError
from kv_transfer.receiver import BaseReceiver
from kv_transfer.transports.tcp.protocol import HELLO_TIMEOUT_S, new_nonce, recv_small, send_small, tune
from kv_transfer.transports.hello_slots import MAX_HELLOS, HelloSlots
from kv_transfer.transports.torch.pair import (
    CONTROL_BYTES,
    IDLE_TIMEOUT,
    KIND_ABORT,
    KIND_CLOSE,
    MAX_PENDING_DECODES,
    TEARDOWN_TIMEOUT,
    destroy_group,
    make_group,
    parse_control,
    wait_work,
)
from kv_transfer.transports.torch.rendezvous import hello_proof, rendezvous_key, reply_mac
from kv_transfer.transports.torch.store import KeySpace, PairStore, serve_store
from kv_transfer.wire import MAX_HEADER_BYTES, WireError, unpack_header

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _ServedPair:
    """What this side holds for one pair, from its accepted hello until it ends."""

    index: int
    space: KeySpace
    conn: socket.socket
    thread: threading.Thread | None = None
    group: object = None  # once built


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
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=128)
        self._endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self._key = rendezvous_key(self.token)
        self._closed = threading.Event()
        self._decoders = ThreadPoolExecutor(max_workers=decode_threads, thread_name_prefix="kv-torch-decode")
        self._slots = HelloSlots("torch KV receiver", hello_timeout_s, self._count_bad_hello, MAX_HELLOS)
        self._pairs: dict[int, _ServedPair] = {}  # by index, each removed when its pair ends
        self._next_index = 0
        self._lock = threading.Lock()
        self._accepter = threading.Thread(target=self._accept_loop, name="kv-torch-accept", daemon=True)
        self._accepter.start()

    # --- rendezvous ---------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the listener was closed
                return
            self._slots.admit(conn)
            threading.Thread(target=self._serve_connection, args=(conn,), name="kv-torch-rendezvous",
                             daemon=True).start()

    def _serve_connection(self, conn: socket.socket) -> None:
        """The hello, then (accepted) the pair's store calls until the sender closes the connection."""
        pair, why = None, "the sender closed its torch rendezvous connection"
        try:
            tune(conn)
            conn.settimeout(self.hello_timeout_s)  # each read; HelloSlots bounds the whole hello
            pair = self._hello(conn)
            if not self._slots.release(conn) or pair is None:  # refused (the reply said why), or out of time
                why = "the torch rendezvous hello ran out of time"
                return
            conn.settimeout(None)  # the pair's set-up bounds the calls: its end closes the connection
            serve_store(conn, pair.space)
        except (OSError, WireError) as exc:  # a hello that broke (counted, logged rarely), or a pair's calls
            why = f"torch rendezvous connection: {type(exc).__name__}: {exc}"
            self._slots.drop(conn, why)
        except Exception:  # a bug: say so
            log.exception("torch KV rendezvous connection failed")
        finally:
            self._slots.release(conn)
            if pair is not None:  # a group not built yet gives up now
                pair.space.close(why)
            conn.close()

    def _hello(self, conn: socket.socket) -> _ServedPair | None:
        """Challenge, check the proof (counted on failure), the layout and the backend; open the pair; reply.

        -> the pair, None when refused. Raises WireError on a malformed hello, OSError when it breaks.
        """
        server_nonce = new_nonce()
        conn.sendall(server_nonce)
        hello = recv_small(conn)
        client_nonce, layout = hello.get("nonce"), hello.get("layout")
        if not isinstance(client_nonce, str) or not isinstance(layout, dict):
            raise WireError("torch rendezvous hello without a nonce or a layout")
        reply, pair = {"ok": False, "error": "", "layout": self.describe(), "index": -1}, None
        try:
            if not self.check_token(hello.get("proof"), hello_proof(self._key, server_nonce, client_nonce)):
                raise TransferError("receiver rejected the cluster token", FailedSide.RECEIVER)
            self.check_handshake(layout)
            if hello.get("backend") != self.backend:
                raise HandshakeError(f"KV handshake mismatch on backend: sender={hello.get('backend')!r} "
                                     f"receiver={self.backend!r}")
            pair = self._open_pair(conn)
            reply.update(ok=True, index=pair.index)
        except (TransferError, HandshakeError) as exc:
            reply["error"] = str(exc)
        reply["mac"] = reply_mac(self._key, server_nonce, client_nonce, reply)
        try:
            send_small(conn, reply)
        except BaseException:
            if pair is not None:
                pair.space.close("the torch rendezvous reply could not be sent")
            raise
        return pair

    def _open_pair(self, conn: socket.socket) -> _ServedPair:
        """A key space and a thread for an accepted hello; TransferError when ``max_groups`` pairs are open."""
        with self._lock:
            if len(self._pairs) >= self.max_groups:
                raise TransferError(f"receiver has {len(self._pairs)} peer groups (max {self.max_groups})",
                                    FailedSide.RECEIVER)
            pair = _ServedPair(self._next_index, KeySpace(), conn)
            self._next_index += 1
            pair.thread = threading.Thread(target=self._serve_pair, args=(pair,), name=f"kv-torch-pair-{pair.index}",
                                           daemon=True)
            self._pairs[pair.index] = pair
        pair.thread.start()  # its group waits in the key space for the sender's keys
        return pair

    def _count_bad_hello(self) -> int:
        with self._cond:
            self._stats.bad_hellos += 1
            return self._stats.bad_hellos

    # --- one pair -----------------------------------------------------------
    def _serve_pair(self, pair: _ServedPair) -> None:
        in_flight: set[str] = set()
        try:
            # Set-up is bounded by this receiver's transfer deadline: a sender that read its reply and
            # never joins costs that long (or until it closes its connection), then frees its group slot.
            setup = timedelta(seconds=self.default_timeout_s)
            group = make_group(PairStore(pair.space, setup), 1, self.backend, setup, self.host, self.interface)
            with self._lock:
                pair.group = group
            self._serve(group, in_flight)
        except Exception as exc:  # peer died, never joined, or the pair broke
            for transfer_id in in_flight:
                self.fail(transfer_id, f"sender connection lost: {str(exc)[:200]}")
        finally:
            with self._lock:
                self._pairs.pop(pair.index, None)
            destroy_group(pair.group)
            pair.group = None
            pair.space.close("the torch pair ended")
            with contextlib.suppress(OSError):
                pair.conn.shutdown(socket.SHUT_RDWR)  # ends its connection's thread

    @property
    def num_groups(self) -> int:
        with self._lock:
            return len(self._pairs)

    def _post_control(self, group):
        slot = torch.empty(CONTROL_BYTES, dtype=torch.uint8, device=self.device)
        return slot, group.recv([slot], 0, 0)

    def _post_payload(self, group, nbytes: int):
        if not (0 <= nbytes <= self.max_payload):
            raise WireError(f"payload of {nbytes} bytes exceeds {self.max_payload}")
        payload = payload_pool.acquire(nbytes, self.device)
        return payload, group.recv([payload], 0, 0)

    def _serve(self, group, in_flight: set[str]) -> None:
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
        while not self._closed.is_set():
            wait_work(work, self._op_timeout)
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
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (close alone does not)
        self._listener.close()
        self._accepter.join(timeout=2)
        self._slots.close()
        # A pair thread ends when its sender says close or dies; give closing senders a moment
        # (a thread still blocked in recv at interpreter exit takes gloo down with it), then
        # destroy the groups left (NCCL wakes their threads; gloo's go when their sender does)
        # and close their key spaces and connections.
        end = time.monotonic() + TEARDOWN_TIMEOUT.total_seconds()
        with self._lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            if pair.thread.is_alive():
                pair.thread.join(timeout=max(0.0, end - time.monotonic()))
        with self._lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            destroy_group(pair.group)
            pair.space.close("receiver closed")
            with contextlib.suppress(OSError):
                pair.conn.shutdown(socket.SHUT_RDWR)
        self._decoders.shutdown(wait=False)
        super().close()
