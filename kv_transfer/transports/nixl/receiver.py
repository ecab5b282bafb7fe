"""NixlReceiver: the decode side of the nixl transport.

At start-up it creates its NIXL agent and registers the whole cache tensor (and, for fp8 / int8, a staging
area) once; it listens for control connections on ``host:port`` (its host only). A connection passes the
mutual hello (``protocol.py``; one deadline and ``MAX_HELLOS`` slots of its own, as the tcp transport's),
then carries pieces, many at once:

    pull (default): chunk -> reserve the blocks (first chunk of a transfer), READ the sender's cells straight
                    into them (fp8 / int8: its staging slot into ours) -> landed
                    ... end -> ack once every chunk of the piece ended
    push:           chunk -> reserve, reply dest (our cells or staging slot) -> the sender WRITEs, its MACed
                    NIXL notification says the chunk landed ... end (every WRITE done) -> ack

A progress thread polls the READs (and the notifications); a landed chunk is checked on a small pool before
its cells count: codec none, the checksum of the cells where they landed; fp8 / int8, the payload in the
staging slot is checked and decoded into the reserved cells (``BaseReceiver.accept``). A mismatch fails
the transfer and frees its blocks, which are never handed over.

Deadlines, cancel and close end a chunk at once (EXPIRED / CANCELLED / FAILED, the transfer's blocks
freed), but a block or staging slot that a READ posted into (or, in push mode, that the sender was told to
write) goes back to the pool only once no byte can land in it any more: the READ left PROC (done, or
failed because the peer went away), or the sender said its WRITEs ended (end / abort), or its connection
closed PUSH_DRAIN_S ago. UCX cannot cancel a READ that is under way; a freed block that a late READ filled
would corrupt the next request that gets it. A sender killed mid-transfer fails what its connection
carried; its READs fail in UCX and their blocks come back.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kv_transfer.codec import get_codec
from kv_transfer.interface import TransferError, TransferStatus
from kv_transfer.layout import HandshakeError
from kv_transfer.receiver import BaseReceiver
from kv_transfer.transports.hello_slots import MAX_HELLOS, HelloSlots
from kv_transfer.transports.nixl.agent import Agent, Region
from kv_transfer.transports.nixl.cells import CacheShape, cells_checksum, paired_descriptors, span_descriptor
from kv_transfer.transports.nixl.protocol import (
    MODES,
    RECEIVER,
    Channel,
    body_bytes,
    mac,
    parse_landed_note,
    recv_hello,
    send_hello,
    channel_key,
)
from kv_transfer.transports.nixl.staging import DEFAULT_STAGING_BYTES, StagingArena, StagingFull
from kv_transfer.transports.tcp.protocol import HELLO_TIMEOUT_S, hello_key, new_nonce, tune
from kv_transfer.transports.tcp.rows import CellRuns
from kv_transfer.wire import WireError, unpack_header

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 256
MAX_CARRIED = 1024          # transfer ids a connection remembers (pruned to the active ones beyond)
MAX_PEER_CACHES = 8         # caches one sender may announce
POLL_S = 0.0005             # progress poll while transfers are in flight
IDLE_WAIT_S = 0.05
PUSH_DRAIN_S = 1.0          # after a push sender's connection closed, its unfinished WRITEs are over


class HeldBlocks:
    """The decode pool as the base receiver sees it: a transfer's blocks go back (``free`` / ``free_transfer``) only
    once no READ or WRITE posted into them can still write there (``settle``); until then they are deferred.

    A pool that reserves by transfer id (`kv_transfer.resharded.TransferBlocks`: the receiving ranks of a
    tensor-parallel decode actor share each transfer's blocks, one copy receiver per head range) gets the
    transfer back whole, once none of its blocks is held here; any other pool gets each block as it settles."""

    def __init__(self, allocator) -> None:
        self.allocator = allocator
        self._holds: Counter[int] = Counter()
        self._deferred: set[int] = set()
        self._deferred_transfers: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    @property
    def num_deferred(self) -> int:
        with self._lock:
            return len(self._deferred) + sum(len(ids) for ids in self._deferred_transfers.values())

    def allocate(self, num_blocks: int) -> list[int] | None:
        return self.allocator.allocate(num_blocks)

    def allocate_transfer(self, transfer_id: str, num_blocks: int) -> list[int] | None:
        by_transfer = getattr(self.allocator, "allocate_transfer", None)
        return by_transfer(transfer_id, num_blocks) if by_transfer else self.allocator.allocate(num_blocks)

    def free(self, block_ids: list[int]) -> None:
        with self._lock:
            now = [block for block in block_ids if not self._holds[block]]
            self._deferred.update(block for block in block_ids if self._holds[block])
        if now:
            self.allocator.free(now)

    def free_transfer(self, transfer_id: str, block_ids: list[int]) -> None:
        by_transfer = getattr(self.allocator, "free_transfer", None)
        if by_transfer is None:
            return self.free(block_ids)
        with self._lock:
            if any(self._holds[block] for block in block_ids):
                self._deferred_transfers[transfer_id] = list(block_ids)
                return
        by_transfer(transfer_id, block_ids)

    def hold(self, block_ids: list[int]) -> None:
        with self._lock:
            self._holds.update(block_ids)

    def settle(self, block_ids: list[int]) -> None:
        with self._lock:
            self._holds.subtract(block_ids)
            freeable = [block for block in block_ids if self._holds[block] <= 0 and block in self._deferred]
            for block in block_ids:
                if self._holds[block] <= 0:
                    del self._holds[block]
            self._deferred.difference_update(freeable)
            transfers = [(tid, ids) for tid, ids in self._deferred_transfers.items()
                         if not any(self._holds[block] for block in ids)]
            for tid, _ in transfers:
                del self._deferred_transfers[tid]
        if freeable:
            self.allocator.free(freeable)
        for tid, ids in transfers:
            self.allocator.free_transfer(tid, ids)


@dataclass(eq=False)
class _Piece:
    """One send() piece as a connection carries it."""

    id: int
    pending: list = field(default_factory=list)    # its chunks not yet landed and checked (or abandoned)
    unsettled: list = field(default_factory=list)  # its chunks that may still hold blocks or a staging slot
    ended: bool = False                            # the sender said end (or abort)
    error: str = ""
    acked: bool = False
    transfer_ids: set = field(default_factory=set)  # transfers it carried chunks of (failed by an abort)


@dataclass(eq=False)
class _Chunk:
    """One chunk in flight: where it lands, what it holds, how far it got."""

    conn: _Conn
    piece: _Piece
    header: object                  # wire.ChunkHeader
    deadline: float                 # time.monotonic()
    transfer: object = None         # direct: the base receiver's transfer (begin_write done)
    block_ids: list = field(default_factory=list)  # direct: destination blocks held
    slot: int | None = None         # staged: our staging offset
    xfer: object = None             # pull: the READ
    landed: bool = False            # its bytes arrived; the check owns it now
    wire_done: bool = False         # no byte can land in what it holds any more
    work_done: bool = False         # checked and counted, or abandoned
    released: bool = False


class _Conn:
    def __init__(self, sock: socket.socket, channel: Channel, agent: str) -> None:
        self.sock, self.channel, self.agent = sock, channel, agent
        self.caches: dict[int, CacheShape] = {}   # pull: the sender's announced caches
        self.staging: Region | None = None        # pull: the sender's staging area
        self.pieces: dict[int, _Piece] = {}
        self.expect: dict[tuple[int, int], _Chunk] = {}  # push: chunks waiting for their notification
        self.transfer_ids: set[str] = set()       # transfers it carried chunks of (failed if it breaks)
        self.lock = threading.Lock()
        self.closed = False
        self.loaded = False          # its sender's metadata is loaded on its account (pull)
        self.num_unsettled = 0       # chunks that may still move bytes

    def piece(self, piece_id: object) -> _Piece:
        if not isinstance(piece_id, int) or isinstance(piece_id, bool):
            raise WireError(f"bad piece id {piece_id!r}")
        with self.lock:
            return self.pieces.setdefault(piece_id, _Piece(piece_id))


class NixlReceiver(BaseReceiver):
    def __init__(self, layout, kv_cache, allocator, *, host: str = "127.0.0.1", port: int = 0, mode: str = "pull",
                 ucx_tls: str = "tcp,shm", backend: str = "UCX", staging_bytes: int = DEFAULT_STAGING_BYTES,
                 workers: int = 2, max_connections: int = MAX_CONNECTIONS, verify_threads: int = 2,
                 hello_timeout_s: float = HELLO_TIMEOUT_S, **kwargs):
        if mode not in MODES:
            raise ValueError(f"nixl mode must be one of {MODES}, got {mode!r}")
        cells = CellRuns.of(kv_cache)
        if cells is None:
            raise ValueError("the nixl transport needs a contiguous KV cache or a head view of one (it registers "
                             "the whole cache)")
        self.held = HeldBlocks(allocator)
        super().__init__(layout, kv_cache, self.held, **kwargs)
        self.mode, self.max_connections, self.hello_timeout_s = mode, max_connections, hello_timeout_s
        self.agent = Agent(f"pdkv-decode-{uuid.uuid4().hex[:12]}", backend=backend, ucx_tls=ucx_tls, host=host,
                           device=kv_cache.device, workers=workers)
        self.cache = CacheShape.of(self.agent.register(cells.memory), cells)
        in_place = get_codec(self.codec).as_stored  # chunks are the cache's own cells: READ straight into them
        self.staging = None if in_place else StagingArena(staging_bytes, kv_cache.device)
        self.staging_region = self.agent.register(self.staging.buffer) if self.staging is not None else None
        self._key = hello_key(self.token)
        self._closed = threading.Event()
        self._conns: dict[int, _Conn] = {}
        self._threads: set[threading.Thread] = set()   # connection threads (joined on close)
        self._by_agent: dict[str, _Conn] = {}
        self._peer_users: Counter[str] = Counter()  # connections whose sender's metadata is loaded (pull)
        self._lock = threading.Lock()
        self._inflight: list[_Chunk] = []
        self._progress_cond = threading.Condition()
        self._verifiers = ThreadPoolExecutor(max_workers=verify_threads, thread_name_prefix="kv-nixl-verify")
        self._readers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-nixl-read")
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=128)
        bound = self._listener.getsockname()[1]
        self._endpoint = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self._slots = HelloSlots("nixl KV receiver", hello_timeout_s, self._count_bad_hello, MAX_HELLOS)
        self._accepter = threading.Thread(target=self._accept_loop, name="kv-nixl-accept", daemon=True)
        self._progress = threading.Thread(target=self._progress_loop, name="kv-nixl-progress", daemon=True)
        self._accepter.start()
        self._progress.start()

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns) + len(self._slots)

    @property
    def num_in_flight(self) -> int:
        """Chunks whose READ or WRITE may still move bytes (a leak check waits for 0)."""
        with self._progress_cond:
            return len(self._inflight)

    # --- connections and the hello ---------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self._slots.admit(sock)
            thread = threading.Thread(target=self._serve, args=(sock,), name="kv-nixl-conn", daemon=True)
            with self._lock:
                self._threads = {t for t in self._threads if t.is_alive()} | {thread}
            thread.start()

    def _count_bad_hello(self) -> int:
        with self._cond:
            self._stats.bad_hellos += 1
            return self._stats.bad_hellos

    def _serve(self, sock: socket.socket) -> None:
        conn = None
        try:
            tune(sock)
            sock.settimeout(self.hello_timeout_s)
            conn = self._hello(sock)
            if conn is None or not self._slots.release(sock):
                return
            sock.settimeout(None)
            with self._lock:
                if len(self._conns) >= self.max_connections:
                    log.warning("nixl KV receiver: %d connections open, the limit; closing a new one", len(self._conns))
                    return
                self._conns[id(conn)] = conn
                self._by_agent[conn.agent] = conn
            self._messages(conn)
        except (OSError, ConnectionError, WireError, ValueError) as exc:
            if conn is None:
                self._slots.drop(sock, f"{type(exc).__name__}: {exc}")
        except Exception:
            log.exception("nixl KV connection failed")
        finally:
            self._slots.release(sock)
            if conn is not None:
                self._drop(conn)
            try:
                sock.close()
            except OSError:
                pass

    def _hello(self, sock: socket.socket) -> _Conn | None:
        """The receiver's half of the hello (``protocol.py``); None when refused (the sender was told why)."""
        server_nonce = new_nonce()
        sock.sendall(server_nonce)
        hello = recv_hello(sock)
        client_nonce = str(hello.get("nonce", ""))
        proof = mac(self._key, b"hello", server_nonce, client_nonce.encode(), body_bytes(hello)).hex()
        if not self.check_token(str(hello.get("mac", "")), proof):
            send_hello(sock, {"ok": False, "error": "receiver rejected the cluster token"})
            return None
        try:
            self.check_handshake(hello.get("layout") or {})
            if hello.get("mode") != self.mode:
                raise HandshakeError(f"KV handshake mismatch on nixl mode: sender={hello.get('mode')!r} "
                                     f"receiver={self.mode!r}")
        except HandshakeError as exc:
            send_hello(sock, {"ok": False, "error": str(exc)})
            return None
        reply = {"ok": True, "error": "", "layout": self.describe(), "agent": self.agent.name}
        if self.mode == "push":  # the sender starts the transfers: it needs our regions
            reply.update(metadata=self.agent.metadata(), cache=self.cache.describe(),
                         staging=self.staging_region.describe() if self.staging_region is not None else None)
        reply["mac"] = mac(self._key, b"reply", server_nonce, client_nonce.encode(), body_bytes(reply)).hex()
        send_hello(sock, reply)
        meta = recv_hello(sock)
        expected = mac(self._key, b"meta", server_nonce, client_nonce.encode(), body_bytes(meta)).hex()
        if not self.check_token(str(meta.get("mac", "")), expected):
            raise WireError("the sender's metadata message is not authenticated")
        agent = str(hello.get("agent", ""))
        conn = _Conn(sock, Channel(sock, channel_key(self._key, server_nonce, client_nonce), RECEIVER), agent)
        if self.mode == "pull":
            self._load_regions(conn, meta)
        return conn

    def _load_regions(self, conn: _Conn, message: dict) -> None:
        """The sender's metadata and the caches / staging it announces (pull: we READ from them)."""
        metadata = message.get("metadata")
        if not isinstance(metadata, bytes):
            raise WireError("nixl region message carries no agent metadata")
        with self._lock:
            name = self.agent.load_peer(metadata)
            if name == conn.agent and not conn.loaded:
                conn.loaded = True
                self._peer_users[name] += 1
        if name != conn.agent:
            raise WireError(f"nixl metadata names another agent than {conn.agent!r}")
        caches = message.get("caches") or []
        if not isinstance(caches, list):
            raise WireError("nixl caches is not a list")
        for entry in caches:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), int):
                raise WireError("malformed nixl cache announcement")
            if len(conn.caches) >= MAX_PEER_CACHES and entry["id"] not in conn.caches:
                conn.caches.pop(next(iter(conn.caches)))
            conn.caches[entry["id"]] = CacheShape.parse(entry)
        if message.get("staging") is not None:
            conn.staging = Region.parse(message["staging"])

    def _drop(self, conn: _Conn) -> None:
        """The connection ended: fail what it carried; its unsettled chunks settle as their bytes stop."""
        with self._lock:
            self._conns.pop(id(conn), None)
            if self._by_agent.get(conn.agent) is conn:
                del self._by_agent[conn.agent]
        with conn.lock:
            conn.closed = True
            pieces = list(conn.pieces.values())
        error = "receiver closed" if self._closed.is_set() else "sender disconnected mid-transfer"
        for piece in pieces:
            piece.error = piece.error or error
            for chunk in list(piece.pending):
                self._abandon(chunk, error)
        for transfer_id in conn.transfer_ids:  # its sender is gone: the rest of them will not come
            self.fail(transfer_id, error)
        if self.mode == "push" and pieces:
            timer = threading.Timer(0 if self._closed.is_set() else PUSH_DRAIN_S, self._settle_pieces, (pieces,))
            timer.daemon = True
            timer.start()
        self._maybe_forget(conn)

    def _maybe_forget(self, conn: _Conn) -> None:
        """Unload a gone sender's metadata once no READ from it may still run and no connection of it uses it."""
        with conn.lock:
            if not conn.closed or conn.num_unsettled or not conn.loaded:
                return
            conn.loaded = False
        with self._lock:
            self._peer_users[conn.agent] -= 1
            if self._peer_users[conn.agent] > 0:
                return
            del self._peer_users[conn.agent]
            self.agent.forget_peer(conn.agent)

    # --- messages ------------------------------------------------------------------------
    def _messages(self, conn: _Conn) -> None:
        while True:
            message = conn.channel.recv()
            kind = message.get("kind")
            if kind == "chunk":
                self._chunk(conn, message)
            elif kind in ("end", "abort"):
                piece = conn.piece(message.get("piece"))
                if kind == "abort":  # its landed chunks count for nothing: the transfer fails as a whole
                    piece.error = piece.error or f"sender aborted mid-transfer: {str(message.get('reason'))[:500]}"
                    for chunk in list(piece.pending):
                        self._abandon(chunk, piece.error)
                    for transfer_id in piece.transfer_ids:
                        self.fail(transfer_id, piece.error)
                piece.ended = True
                if self.mode == "push":  # the sender's WRITEs of this piece are over
                    self._settle_pieces([piece])
                self._maybe_ack(conn, piece)
            elif kind == "region" and self.mode == "pull":
                self._load_regions(conn, message)
            else:
                raise WireError(f"unexpected nixl control message {kind!r}")

    def _chunk(self, conn: _Conn, message: dict) -> None:
        piece = conn.piece(message.get("piece"))
        header_bytes = message.get("header")
        header = unpack_header(header_bytes if isinstance(header_bytes, bytes) else b"")
        self._carried(conn, header.transfer_id)
        piece.transfer_ids.add(header.transfer_id)
        if piece.error:  # the piece was refused: take nothing more of it
            return self._refuse(conn, piece, header, piece.error)
        try:
            self.check_header(header)
            deadline_s = header.deadline_ms / 1000 if header.deadline_ms > 0 else self.default_timeout_s
            chunk = _Chunk(conn, piece, header, time.monotonic() + min(deadline_s, self.max_deadline_s))
            if get_codec(header.codec).as_stored:
                self._reserve_cells(chunk)
            else:
                chunk.slot = self.staging.acquire(header.payload_len, chunk.deadline)
        except (TransferError, StagingFull, ValueError) as exc:
            if not isinstance(exc, TransferError):  # nothing reserved the transfer's failure yet
                self.fail(header.transfer_id, str(exc))
            return self._refuse(conn, piece, header, str(exc))
        with conn.lock:
            piece.pending.append(chunk)
            piece.unsettled.append(chunk)
            conn.num_unsettled += 1
        if self.mode == "pull":  # READs start on their own pool: several at once while this thread reads messages
            try:
                self._readers.submit(self._start, chunk, message.get("src"))
            except RuntimeError:  # closing: the pool takes no more
                chunk.wire_done = True
                self._abandon(chunk, "receiver closed")
        else:
            self._start(chunk, None)

    def _start(self, chunk: _Chunk, src: object) -> None:
        try:
            if self.mode == "pull":
                self._read(chunk, src)
            else:
                self._offer(chunk)
        except (WireError, ValueError, RuntimeError, OSError) as exc:
            chunk.wire_done = True  # nothing was posted
            self._abandon(chunk, str(exc))

    def _carried(self, conn: _Conn, transfer_id: str) -> None:
        """Remember that ``conn`` carried a chunk of ``transfer_id`` (at most MAX_CARRIED active ones)."""
        conn.transfer_ids.add(transfer_id)
        if len(conn.transfer_ids) > MAX_CARRIED:
            conn.transfer_ids = {t for t in conn.transfer_ids if self.status(t) in (TransferStatus.PENDING,
                                                                                    TransferStatus.TRANSFERRING)}

    def _reserve_cells(self, chunk: _Chunk) -> None:
        """Reserve the transfer's blocks (its first chunk) and hold this chunk's: ``begin_write`` without counting
        a writer, since the READ may outlive the transfer (HeldBlocks keeps the blocks out of the pool instead);
        the check counts one (``_verify``)."""
        header = chunk.header
        transfer = self._reserved(header)
        with transfer.lock:
            transfer.refuse_if_ended()
            transfer.status = TransferStatus.TRANSFERRING
            chunk.block_ids = transfer.dst_block_ids[header.block_start : header.block_end]
            self.held.hold(chunk.block_ids)
        chunk.transfer = transfer
        chunk.deadline = min(chunk.deadline, transfer.deadline)

    def _read(self, chunk: _Chunk, src: object) -> None:
        """Pull: post the READ of the sender's cells (or staging slot) into ours."""
        header, conn = chunk.header, chunk.conn
        if not isinstance(src, dict):
            raise WireError("nixl chunk without a source")
        if chunk.slot is None:
            cache = conn.caches.get(src.get("cache"))
            blocks = src.get("blocks")
            if cache is None or not isinstance(blocks, list) or len(blocks) != header.block_end - header.block_start \
                    or not all(isinstance(b, int) and 0 <= b < cache.num_blocks for b in blocks) \
                    or cache.nbytes != self.cache.nbytes:
                raise WireError(f"bad nixl source for chunk {header.chunk_index}")
            local, remote = paired_descriptors(self.cache, chunk.block_ids, cache, blocks,
                                               (header.layer_start, header.layer_end))
            local_mem, remote_mem = self.cache.region.mem, cache.region.mem
        else:
            offset, length = src.get("offset"), src.get("length")
            if conn.staging is None or not isinstance(offset, int) or length != header.payload_len \
                    or offset < 0 or offset + length > conn.staging.nbytes:
                raise WireError(f"bad nixl staging source for chunk {header.chunk_index}")
            local = span_descriptor(self.staging_region, chunk.slot, length)
            remote = span_descriptor(conn.staging, offset, length)
            local_mem, remote_mem = self.staging_region.mem, conn.staging.mem
        chunk.xfer = self.agent.post("READ", local, local_mem, remote, remote_mem, conn.agent)
        with self._progress_cond:
            self._inflight.append(chunk)
            self._progress_cond.notify()
        if self.agent.state(chunk.xfer) == "DONE":  # landed already (shared memory): no wait for the poll
            with conn.lock:
                if chunk.landed or chunk.work_done:
                    return
                chunk.landed = chunk.wire_done = True
            self._verify(chunk)  # here, while the cells are hot and the other thread READs the next chunk

    def _offer(self, chunk: _Chunk) -> None:
        """Push: tell the sender where to WRITE the chunk; its notification will say it landed."""
        header, conn = chunk.header, chunk.conn
        with conn.lock:
            conn.expect[(chunk.piece.id, header.chunk_index)] = chunk
        with self._progress_cond:
            self._inflight.append(chunk)
            self._progress_cond.notify()
        dst = {"blocks": chunk.block_ids} if chunk.slot is None else {"offset": chunk.slot,
                                                                      "length": header.payload_len}
        conn.channel.send({"kind": "dest", "piece": chunk.piece.id, "chunk": header.chunk_index, "dst": dst,
                           "error": ""})

    def _refuse(self, conn: _Conn, piece: _Piece, header, error: str) -> None:
        """A chunk not taken: push, the sender waits for its dest; pull, a staged one frees its slot on landed."""
        piece.error = piece.error or error
        reply = {"piece": piece.id, "chunk": header.chunk_index, "error": piece.error}
        if self.mode == "push":
            self._send(conn, {"kind": "dest", **reply, "dst": None})
        elif not get_codec(header.codec).as_stored:
            self._send(conn, {"kind": "landed", **reply})

    # --- progress: READs, notifications, deadlines -----------------------------------------
    def _progress_loop(self) -> None:
        while not self._closed.is_set():
            with self._progress_cond:
                if not self._inflight:
                    self._progress_cond.wait(IDLE_WAIT_S)
                chunks = list(self._inflight)
            if not chunks:
                continue
            if self.mode == "push":
                self._notifications()
            now = time.monotonic()
            for chunk in chunks:
                state = self.agent.state(chunk.xfer) if chunk.xfer is not None else "PROC"
                with chunk.conn.lock:
                    settled = state != "PROC" and not chunk.wire_done
                    landed = settled and state == "DONE" and not chunk.work_done
                    chunk.wire_done = chunk.wire_done or settled
                    chunk.landed = chunk.landed or landed
                    late = not (chunk.landed or chunk.work_done) and (now > chunk.deadline or _ended(chunk))
                if landed:
                    self._verifiers.submit(self._verify, chunk)
                elif settled and not chunk.landed:
                    self._abandon(chunk, "nixl READ failed (the sender went away?)")
                elif late:
                    self._abandon(chunk, "deadline passed before the KV chunk landed", TransferStatus.EXPIRED)
                self._release_if_over(chunk)
            time.sleep(POLL_S)

    def _notifications(self) -> None:
        for agent, notes in self.agent.notifications().items():
            with self._lock:
                conn = self._by_agent.get(agent)
            for note in notes:
                landed = parse_landed_note(conn.channel.key, note) if conn is not None else None
                if landed is None:  # not made under the channel key of a connected sender
                    with self._cond:
                        self._stats.auth_failures += 1
                    continue
                with conn.lock:
                    chunk = conn.expect.pop(landed, None)
                    if chunk is None:
                        continue
                    check = not chunk.work_done  # else: abandoned meanwhile, its blocks can go back now
                    chunk.landed = chunk.landed or check
                    chunk.wire_done = True
                if check:
                    self._verifiers.submit(self._verify, chunk)
                else:
                    self._release_if_over(chunk)

    def _verify(self, chunk: _Chunk) -> None:
        """A landed chunk: check it (and decode it, fp8 / int8), count its cells, then end it."""
        header, error = chunk.header, ""
        try:
            if chunk.slot is None:
                with chunk.transfer.lock:
                    chunk.transfer.refuse_if_ended()
                    chunk.transfer.writers += 1
                try:
                    ok = cells_checksum(self.kv_cache, (header.layer_start, header.layer_end),
                                        chunk.block_ids) == header.checksum
                except BaseException:
                    self.end_write(header, chunk.transfer, written=False)
                    raise
                self.end_write(header, chunk.transfer, written=ok)
                if not ok:
                    error = f"checksum mismatch in chunk {header.chunk_index}"
                    self.fail(header.transfer_id, error)
            else:
                self.accept(header, self.staging.view(chunk.slot, header.payload_len))
        except TransferError as exc:
            error = str(exc)
        except Exception as exc:  # a bug: fail the transfer, keep the connection in step
            log.exception("nixl KV chunk check failed")
            error = f"{type(exc).__name__}: {exc}"
            self.fail(header.transfer_id, error)
        self._chunk_over(chunk, error)

    def _abandon(self, chunk: _Chunk, error: str, status: TransferStatus = TransferStatus.FAILED) -> None:
        """End a chunk that will not land (in time): fail its transfer; what it holds stays held until settled."""
        with chunk.conn.lock:
            if chunk.work_done:
                return
            chunk.work_done = True  # push: its notification may still come, and settle it
        if not self.fail(chunk.header.transfer_id, error, status):
            self._fail_unknown(chunk.header, error)  # a staged chunk abandoned before its transfer was created
        self._chunk_over(chunk, error)

    def _chunk_over(self, chunk: _Chunk, error: str) -> None:
        """The chunk is checked or abandoned: pull, a staged chunk's landed frees the sender's slot; the piece is
        acked when it was the last."""
        conn, piece = chunk.conn, chunk.piece
        with conn.lock:
            chunk.work_done = True
            if chunk in piece.pending:
                piece.pending.remove(chunk)
            piece.error = piece.error or error
        if self.mode == "pull" and chunk.slot is not None:
            self._send(conn, {"kind": "landed", "piece": piece.id, "chunk": chunk.header.chunk_index,
                              "error": error})
        self._release_if_over(chunk)
        self._maybe_ack(conn, piece)

    def _release_if_over(self, chunk: _Chunk) -> None:
        """Give back what the chunk holds once no byte can land in it and it is checked or abandoned."""
        with chunk.conn.lock:
            if chunk.released or not (chunk.wire_done and chunk.work_done):
                return
            chunk.released = True
            chunk.conn.expect.pop((chunk.piece.id, chunk.header.chunk_index), None)
            chunk.conn.num_unsettled -= 1
            if chunk in chunk.piece.unsettled:
                chunk.piece.unsettled.remove(chunk)
        with self._progress_cond:
            if chunk in self._inflight:
                self._inflight.remove(chunk)
        if chunk.xfer is not None:
            self.agent.release(chunk.xfer)
        if chunk.slot is not None:
            self.staging.release(chunk.slot)
        if chunk.block_ids:
            self.held.settle(chunk.block_ids)
        self._maybe_forget(chunk.conn)

    def _settle_pieces(self, pieces: list[_Piece]) -> None:
        """Push: the sender's WRITEs into these pieces are over (end / abort, or its connection is long gone)."""
        for piece in pieces:
            for chunk in list(piece.unsettled):
                chunk.wire_done = True
                self._release_if_over(chunk)

    def _maybe_ack(self, conn: _Conn, piece: _Piece) -> None:
        with conn.lock:
            if piece.acked or not piece.ended or piece.pending:
                return
            piece.acked = True
            conn.pieces.pop(piece.id, None)
        self._send(conn, {"kind": "ack", "piece": piece.id, "error": piece.error})

    def _send(self, conn: _Conn, message: dict) -> None:
        if conn.closed:
            return
        try:
            conn.channel.send(message)
        except OSError:  # the connection broke: its reader fails what it carried
            pass

    # --- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._slots.close()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accepter.join(timeout=2)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:  # they fail what their connections carried; none is left running at exit
            thread.join(timeout=5)
        self._readers.shutdown(wait=True)  # every READ that starts has started: all are in _inflight now
        self._progress.join(timeout=2)
        with self._progress_cond:
            chunks, self._inflight = list(self._inflight), []
        for chunk in chunks:  # closing: what is still in flight is abandoned and released
            self._abandon(chunk, "receiver closed")
            chunk.wire_done = True
            self._release_if_over(chunk)
        self._verifiers.shutdown(wait=True)
        super().close()
        self.agent.close()


def _ended(chunk: _Chunk) -> bool:
    """The chunk's transfer ended meanwhile (cancelled, failed by another chunk, closing)."""
    transfer = chunk.transfer
    return transfer is not None and transfer.status.is_terminal
