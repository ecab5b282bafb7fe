"""NixlSender: the prefill side of the nixl transport.

At start-up it creates its NIXL agent and registers the prefill cache (``kv_cache``; a piece from another
cache tensor registers that one on first sight) and, for fp8 / int8, a staging area, once. Per destination
it keeps one control connection (``protocol.py``), opened by the first piece with the mutual hello and
shared by every piece to it (a reader thread takes the receiver's messages). A piece is a run of chunks:

    pull (default): chunk {header, src} for each chunk -> end; the receiver READs each chunk (codec none: the
                    cache's cells straight; fp8 / int8: the chunk encoded into our staging slot, freed when
                    its ``landed`` comes back) and acks the piece once every chunk landed and checked
    push:           chunk {header} -> dest -> WRITE (with a MACed NIXL notification) for each chunk; end once
                    every WRITE is done -> ack

Each chunk header carries the checksum of its cells (or of its encoded payload), taken here. The piece's
source blocks are leased to the transfer until its deadline: a receiver that never reads them cannot hold
them longer (the handle ends EXPIRED and the prefill worker frees them); an abort tells the receiver to
drop the piece. A broken connection fails its pieces (side TRANSPORT) and the next piece reconnects.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kv_transfer.buffers import scratch_pool
from kv_transfer.chunker import MIN_CHUNK_BYTES, ChunkJob, chunk_header, piece_nbytes, piece_plans, plan_chunks
from kv_transfer.interface import FailedSide, KVPiece, TransferError, TransferStatus
from kv_transfer.layout import HandshakeError, check_compatible
from kv_transfer.sender import BaseSender
from kv_transfer.transports.nixl.agent import Agent, Region
from kv_transfer.transports.nixl.cells import CacheShape, cells_checksum, paired_descriptors, span_descriptor
from kv_transfer.transports.nixl.protocol import (
    MODES,
    SENDER,
    Channel,
    body_bytes,
    landed_note,
    mac,
    new_client_nonce,
    recv_hello,
    send_hello,
    channel_key,
)
from kv_transfer.transports.nixl.staging import DEFAULT_STAGING_BYTES, StagingArena, StagingFull
from kv_transfer.transports.tcp.rows import CellRuns
from kv_transfer.transports.tcp.protocol import NONCE_BYTES, hello_key, recv_exact, split_endpoint, tune
from kv_transfer.wire import WireError, host_checksum, pack_header
from proto.internal_auth import token_matches

CONNECT_TIMEOUT_S = 10.0
MAX_CACHES = 8          # registered caches or head views of one (a prefill actor's sender has one)
WRITE_POLL_S = 0.0005
RECLAIM_S = 0.002       # push: an encoder waiting for staging room looks for finished WRITEs this often
READ_SCALE = 4          # a codec-none chunk: one READ of up to this many times chunk_bytes ...
READ_STAGES = 4         # ... and at least this many of them per piece (at least MIN_CHUNK_BYTES each)


@dataclass(frozen=True, slots=True)
class _Cache:
    id: int
    tensor: torch.Tensor
    shape: CacheShape

    def describe(self) -> dict:
        return {"id": self.id, **self.shape.describe()}


@dataclass(slots=True)
class _Outgoing:
    """One chunk ready to go: its header, where its bytes are, what it holds."""

    header: object
    header_bytes: bytes
    src: dict
    cache: _Cache | None = None
    block_ids: tuple = ()
    slot: int | None = None


class _Slots:
    """The staging slots one piece holds; closed when the piece ends, after which a late encode's slot goes back.

    Pull: a slot goes back when the receiver's ``landed`` says its READ ended. Push: when the WRITE from it
    is done (``written``); the encoder waiting for room looks for those itself, since the thread that posts
    the WRITEs may be waiting for that very encode."""

    def __init__(self, arena: StagingArena, state=None) -> None:
        self.arena, self.state = arena, state
        self._held: set[int] = set()
        self._writes: list[tuple[object, int]] = []   # push: (WRITE, its slot) not seen done yet
        self._closed = False
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, deadline: float) -> int:
        while True:
            self._reclaim()
            wait_until = deadline if self.state is None else min(deadline, time.monotonic() + RECLAIM_S)
            try:
                offset = self.arena.acquire(nbytes, wait_until)
                break
            except StagingFull:
                if wait_until >= deadline or nbytes > self.arena.nbytes:
                    raise
        with self._lock:
            if not self._closed:
                self._held.add(offset)
                return offset
        self.arena.release(offset)
        raise TransferError("the piece ended while its chunk was encoded", FailedSide.SENDER)

    def written(self, xfer, offset: int) -> None:
        """Push: the slot goes back once this WRITE from it left PROC."""
        with self._lock:
            self._writes.append((xfer, offset))

    def _reclaim(self) -> None:
        with self._lock:
            writes = list(self._writes)
        done = [(xfer, offset) for xfer, offset in writes if self.state(xfer) != "PROC"] if writes else []
        with self._lock:
            self._writes = [entry for entry in self._writes if entry not in done]
        for _, offset in done:
            self.release(offset)

    def release(self, offset: int | None) -> None:
        with self._lock:
            if offset not in self._held:
                return
            self._held.discard(offset)
        self.arena.release(offset)

    def close(self) -> None:
        with self._lock:
            self._closed, held, self._held = True, self._held, set()
        for offset in held:
            self.arena.release(offset)


@dataclass(eq=False)
class _OutPiece:
    id: int
    slots: _Slots | None
    slot_of: dict = field(default_factory=dict)     # pull: chunk index -> staging offset
    offered: dict = field(default_factory=dict)     # push: chunk index -> chunk asked about, not yet written
    writes: list = field(default_factory=list)      # push: the WRITEs posted
    on_dest: object = None                          # push: posts a chunk's WRITE when its destination comes
    failed: TransferError | None = None             # push: a WRITE that could not be posted
    closed: bool = False                            # push: aborting: no more WRITEs are posted
    error: str | None = None                        # set once the piece is over ("" = acked without error)
    broken: str = ""                                # the connection broke
    cond: threading.Condition = field(default_factory=threading.Condition)

    def wait(self, ready, deadline: float, what: str) -> None:
        with self.cond:
            while not ready() and not self.broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"deadline passed waiting for the nixl receiver's {what}",
                                        FailedSide.TRANSPORT, TransferStatus.EXPIRED)
                self.cond.wait(left)
        if self.broken:
            raise TransferError(self.broken, FailedSide.TRANSPORT)


class _Link:
    """The control connection to one receiver: its channel, the pieces on it, a reader for its messages."""

    def __init__(self, dest: str, sock: socket.socket, channel: Channel, peer_agent: str, reply: dict) -> None:
        self.dest, self.sock, self.channel, self.peer_agent = dest, sock, channel, peer_agent
        self.remote_cache = CacheShape.parse(reply["cache"]) if reply.get("cache") else None       # push
        self.remote_staging = Region.parse(reply["staging"]) if reply.get("staging") else None     # push
        self.layout: dict = reply.get("layout") or {}
        self.announced: set[int] = set()  # pull: caches the receiver knows
        self.pieces: dict[int, _OutPiece] = {}
        self.broken = ""
        self._next = 0
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="kv-nixl-link", daemon=True)
        self._reader.start()

    def open(self, slots: _Slots | None) -> _OutPiece:
        with self._lock:
            if self.broken:
                raise TransferError(self.broken, FailedSide.TRANSPORT)
            self._next += 1
            piece = self.pieces[self._next] = _OutPiece(self._next, slots)
        return piece

    def close_piece(self, piece: _OutPiece) -> None:
        with self._lock:
            self.pieces.pop(piece.id, None)

    def send(self, message: dict) -> None:
        try:
            self.channel.send(message)
        except OSError as exc:
            self._break(f"nixl control connection to {self.dest} broke: {exc}")
            raise TransferError(self.broken, FailedSide.TRANSPORT) from None

    def _read(self) -> None:
        try:
            while True:
                message = self.channel.recv()
                with self._lock:
                    piece = self.pieces.get(message.get("piece"))
                if piece is not None:
                    self._dispatch(piece, message)
                del piece  # holds the piece's staging slots: not past its end
        except (OSError, ConnectionError, WireError) as exc:
            self._break(f"nixl control connection to {self.dest} broke: {exc}")

    @staticmethod
    def _dispatch(piece: _OutPiece, message: dict) -> None:
        kind, chunk, error = message.get("kind"), message.get("chunk"), str(message.get("error") or "")
        if kind == "dest" and piece.on_dest is not None:  # push: WRITE it now, whatever the sender's thread does
            piece.on_dest(message)
        with piece.cond:
            if kind == "landed" and piece.slots is not None:
                piece.slots.release(piece.slot_of.pop(chunk, None))
            elif kind == "ack":
                piece.error = error
            piece.cond.notify_all()

    def _break(self, reason: str) -> None:
        with self._lock:
            self.broken = self.broken or reason
            pieces = list(self.pieces.values())
        for piece in pieces:
            with piece.cond:
                piece.broken = self.broken
                piece.cond.notify_all()

    def close(self) -> None:
        """Close the connection and wait for its reader (a daemon thread left running at interpreter exit could
        free tensors without the GIL)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)


class NixlSender(BaseSender):
    def __init__(self, layout, *, kv_cache: torch.Tensor | None = None, host: str = "127.0.0.1", mode: str = "pull",
                 ucx_tls: str = "tcp,shm", backend: str = "UCX", staging_bytes: int = DEFAULT_STAGING_BYTES,
                 workers: int = 2, device: torch.device | str | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, **kwargs) -> None:
        if mode not in MODES:
            raise ValueError(f"nixl mode must be one of {MODES}, got {mode!r}")
        super().__init__(layout, **kwargs)
        self.mode, self.connect_timeout_s = mode, connect_timeout_s
        device = kv_cache.device if kv_cache is not None else torch.device(device or "cpu")
        self.agent = Agent(f"pdkv-prefill-{uuid.uuid4().hex[:12]}", backend=backend, ucx_tls=ucx_tls, host=host,
                           device=device, workers=workers)
        self._key = hello_key(self.token)
        self._caches: OrderedDict[tuple[int, int], _Cache] = OrderedDict()
        self._cache_ids = 0
        self._cache_lock = threading.Lock()
        self.staging = None if self.codec.as_stored else StagingArena(staging_bytes, device)
        self.staging_region = self.agent.register(self.staging.buffer) if self.staging is not None else None
        self._links: dict[str, _Link] = {}
        self._link_locks: dict[str, threading.Lock] = {}
        self._links_lock = threading.Lock()
        self._local = threading.local()
        if kv_cache is not None:
            self._cache_of(kv_cache)

    # --- registered caches -----------------------------------------------------------------
    def _cache_of(self, kv_cache) -> _Cache:
        """The registration of ``kv_cache``'s memory and where its cells lie (made now, once, for a cache or head
        view not seen before)."""
        cells = CellRuns.of(kv_cache)
        if cells is None:
            raise ValueError("the nixl transport needs a contiguous KV cache or a head view of one (it registers "
                             "the whole cache)")
        key = (cells.memory.data_ptr(), cells.memory.numel(), cells.num_blocks, cells.cell_bytes, cells.runs)
        with self._cache_lock:
            cache = self._caches.get(key)
            if cache is not None:  # we hold its memory: it cannot have been reused
                self._caches.move_to_end(key)
                return cache
            self._cache_ids += 1
            cache = _Cache(self._cache_ids, cells.memory, CacheShape.of(self.agent.register(cells.memory), cells))
            self._caches[key] = cache
            stale = list(self._caches.items())[:-MAX_CACHES]
            for old_key, _ in stale:
                self._caches.pop(old_key, None)
        for _, old in stale:
            self.agent.deregister(old.tensor)
        return cache

    # --- connections ---------------------------------------------------------------------
    def _remote_handshake(self, dest: str, local: dict) -> dict:
        return self._link(dest, time.monotonic() + self.connect_timeout_s).layout

    def _link(self, dest: str, deadline_at: float) -> _Link:
        with self._links_lock:
            lock = self._link_locks.setdefault(dest, threading.Lock())
        with lock:
            link = self._links.get(dest)
            if link is not None and not link.broken:
                return link
            if link is not None:
                link.close()
            link = self._links[dest] = self._connect(dest, deadline_at)
            return link

    def _connect(self, dest: str, deadline_at: float) -> _Link:
        """A new control connection that passed the hello (see ``protocol.py``)."""
        try:
            host, port = split_endpoint(dest)
        except ValueError as exc:
            raise TransferError(str(exc), FailedSide.SENDER) from None
        timeout = max(0.01, min(self.connect_timeout_s, deadline_at - time.monotonic()))
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise TransferError(f"cannot connect to the nixl KV receiver at {dest}: {exc}", FailedSide.TRANSPORT) \
                from None
        try:
            tune(sock)
            server_nonce = bytes(recv_exact(sock, NONCE_BYTES))
            client_nonce = new_client_nonce()
            hello = {"nonce": client_nonce, "layout": self.describe(), "mode": self.mode, "agent": self.agent.name}
            hello["mac"] = mac(self._key, b"hello", server_nonce, client_nonce.encode(), body_bytes(hello)).hex()
            send_hello(sock, hello)
            reply = recv_hello(sock)
            if not reply.get("ok"):
                error = str(reply.get("error"))
                raise HandshakeError(error) if "mismatch" in error else TransferError(error, FailedSide.RECEIVER)
            expected = mac(self._key, b"reply", server_nonce, client_nonce.encode(), body_bytes(reply)).hex()
            if not token_matches(str(reply.get("mac", "")), expected):
                raise TransferError(f"the nixl KV receiver at {dest} did not prove the cluster secret",
                                    FailedSide.TRANSPORT)
            check_compatible(self.describe(), reply.get("layout") or {})
            meta: dict = {}
            if self.mode == "pull":  # the receiver starts the transfers: it needs our regions
                meta = {"metadata": self.agent.metadata(), "caches": [c.describe() for c in self._registered()],
                        "staging": self.staging_region.describe() if self.staging_region is not None else None}
            meta["mac"] = mac(self._key, b"meta", server_nonce, client_nonce.encode(), body_bytes(meta)).hex()
            send_hello(sock, meta)
            peer_agent = str(reply.get("agent", ""))
            if self.mode == "push" and self.agent.load_peer(reply.get("metadata") or b"") != peer_agent:
                raise TransferError(f"the nixl KV receiver at {dest} sent metadata of another agent",
                                    FailedSide.TRANSPORT)
            sock.settimeout(None)
            link = _Link(dest, sock, Channel(sock, channel_key(self._key, server_nonce, client_nonce), SENDER),
                         peer_agent, reply)
        except (OSError, ConnectionError, WireError, ValueError) as exc:
            sock.close()
            raise TransferError(f"nixl KV hello with {dest} failed: {exc}", FailedSide.TRANSPORT) from None
        except BaseException:
            sock.close()
            raise
        if self.mode == "pull":
            link.announced.update(cache.id for cache in self._registered())
        return link

    def _registered(self) -> list[_Cache]:
        with self._cache_lock:
            return list(self._caches.values())

    def forget(self, dest: str) -> None:
        super().forget(dest)
        with self._links_lock:
            link = self._links.pop(dest, None)
        if link is not None:
            link.close()

    # --- chunks ----------------------------------------------------------------------------
    def _jobs(self, piece: KVPiece, deadline_at: float) -> list[ChunkJob]:
        """Codec none (or a quantized cache's stored cells): describe the cache's cells, checksum taken here;
        fp8 / int8: encode into staging slots."""
        layout, codec, kv_cache = self.layout, self.codec, piece.kv_cache
        if codec.as_stored:
            try:
                cache = self._cache_of(kv_cache)
            except ValueError as exc:
                raise TransferError(str(exc), FailedSide.SENDER) from None
            cell_bytes = cache.shape.nbytes
            plans = self._read_plans(piece, cell_bytes)
            self._local.slots = None

            def describe(index: int, plan) -> _Outgoing:
                ids = tuple(piece.block_ids[plan.block_start : plan.block_end])
                layers = (plan.layer_start, plan.layer_end)
                nbytes = (layers[1] - layers[0]) * len(ids) * cell_bytes
                header = chunk_header(piece, layout, codec, plan, index, len(plans), nbytes,
                                      cells_checksum(kv_cache, layers, ids), deadline_at)
                return _Outgoing(header, pack_header(header), {"cache": cache.id, "blocks": list(ids)}, cache, ids)

            return [ChunkJob(functools.partial(describe, index, plan),
                             (plan.layer_end - plan.layer_start) * (plan.block_end - plan.block_start) * cell_bytes)
                    for index, plan in enumerate(plans)]
        slots = self._local.slots = _Slots(self.staging, self.agent.state if self.mode == "push" else None)
        cell_shape = (1, 1, 2, layout.num_kv_heads, layout.block_size, layout.head_dim)
        plans = piece_plans(piece, codec.payload_nbytes(cell_shape, layout.dtype), self.chunk_bytes)
        index_of = torch.tensor(piece.block_ids, dtype=torch.long, device=kv_cache.device)

        def size(plan) -> int:
            shape = (plan.layer_end - plan.layer_start, plan.block_end - plan.block_start, *cell_shape[2:])
            return codec.payload_nbytes(shape, layout.dtype)

        def encode(index: int, plan) -> _Outgoing:
            nbytes = size(plan)
            offset = slots.acquire(nbytes, deadline_at)
            out = self.staging.view(offset, nbytes)
            with scratch_pool.lease() as scratch:
                codec.encode_from(kv_cache, (plan.layer_start, plan.layer_end),
                                  index_of[plan.block_start : plan.block_end], out, scratch)
            header = chunk_header(piece, layout, codec, plan, index, len(plans), nbytes, host_checksum(out),
                                  deadline_at)
            return _Outgoing(header, pack_header(header), {"offset": offset, "length": nbytes}, slot=offset)

        return [ChunkJob(functools.partial(encode, index, plan), size(plan)) for index, plan in enumerate(plans)]

    def _read_plans(self, piece: KVPiece, cell_bytes: int) -> list:
        """A codec-none piece's chunks: each one READ (and one checksum) of its cells. Nothing is framed or
        buffered per chunk, so they may be READ_SCALE x ``chunk_bytes`` (at least READ_STAGES of them, of at
        least MIN_CHUNK_BYTES, so the checksums overlap the READs): fewer round trips, the same pipeline."""
        total = piece_nbytes(piece.layers, piece.blocks, cell_bytes)
        read_bytes = min(self.chunk_bytes * READ_SCALE, max(MIN_CHUNK_BYTES, total // READ_STAGES))
        return plan_chunks(piece.layers, len(piece.block_ids), cell_bytes, read_bytes, piece.blocks)

    def _ship(self, dest: str, chunks: Iterator[_Outgoing], deadline_at: float, transfer_id: str = "",
              sizes: list[int] | None = None) -> int:
        slots, self._local.slots = getattr(self._local, "slots", None), None
        link = piece = None
        try:
            link = self._link(dest, deadline_at)
            piece = link.open(slots)
            if self.mode == "push":
                piece.on_dest = functools.partial(self._write_to, link, piece)
            wire_bytes = 0
            while True:
                try:
                    chunk = next(chunks)
                except StopIteration:
                    break
                except StagingFull as exc:  # the handler below tells the receiver
                    expired = time.monotonic() >= deadline_at
                    raise TransferError(str(exc), FailedSide.SENDER,
                                        TransferStatus.EXPIRED if expired else TransferStatus.FAILED) from None
                except TransferError:
                    raise
                except Exception as exc:  # encode failed: tell the receiver to drop the piece
                    self._abort(link, piece, f"{type(exc).__name__}: {exc}")
                    raise
                if time.monotonic() > deadline_at:
                    raise TransferError("the transfer deadline passed", FailedSide.TRANSPORT, TransferStatus.EXPIRED)
                if self.mode == "pull":
                    self._announce(link, chunk.cache)
                    with piece.cond:
                        if chunk.slot is not None:
                            piece.slot_of[chunk.header.chunk_index] = chunk.slot
                    link.send({"kind": "chunk", "piece": piece.id, "header": chunk.header_bytes, "src": chunk.src})
                else:
                    with piece.cond:
                        piece.offered[chunk.header.chunk_index] = chunk
                    link.send({"kind": "chunk", "piece": piece.id, "header": chunk.header_bytes})
                    if piece.failed is not None:
                        raise piece.failed
                wire_bytes += chunk.header.payload_len
            if self.mode == "push":
                piece.wait(lambda: not piece.offered or piece.failed is not None, deadline_at, "destinations")
                if piece.failed is not None:
                    raise piece.failed
                self._wait_writes(piece.writes, deadline_at)
            if time.monotonic() > deadline_at:
                raise TransferError("the transfer deadline passed", FailedSide.TRANSPORT, TransferStatus.EXPIRED)
            link.send({"kind": "end", "piece": piece.id})
            piece.wait(lambda: piece.error is not None, deadline_at, "ack")
            if piece.error:
                raise TransferError(piece.error, FailedSide.RECEIVER)
            return wire_bytes
        except TransferError as exc:
            if piece is not None and piece.error is None and not link.broken:  # not acked: the receiver drops it
                self._abort(link, piece, str(exc))
            if link is not None and link.broken:
                self.forget(dest)  # the next piece reconnects
            raise
        finally:
            if piece is not None:
                link.close_piece(piece)
                with piece.cond:
                    piece.closed, writes = True, list(piece.writes)
                for xfer in writes:
                    if self.agent.state(xfer) != "PROC":
                        self.agent.release(xfer)
            if slots is not None:
                slots.close()

    def _announce(self, link: _Link, cache: _Cache | None) -> None:
        """Pull: a cache the receiver has not heard of yet goes to it (with our metadata) before its chunks."""
        if cache is None or cache.id in link.announced:
            return
        link.send({"kind": "region", "metadata": self.agent.metadata(), "caches": [cache.describe()],
                   "staging": self.staging_region.describe() if self.staging_region is not None else None})
        link.announced.add(cache.id)

    def _write_to(self, link: _Link, piece: _OutPiece, dest: dict) -> None:
        """Push, on the link's reader: WRITE the chunk whose destination came back (or record why not). Under
        the piece's lock, so that an abort sees every WRITE posted (and none is posted after it)."""
        with piece.cond:
            chunk = piece.offered.get(dest.get("chunk"))
            if chunk is None or piece.failed is not None or piece.closed:
                return
            try:
                xfer = self._write(link, piece, chunk, dest)
            except TransferError as exc:
                piece.failed = exc
                piece.cond.notify_all()
                return
            piece.writes.append(xfer)
            piece.offered.pop(chunk.header.chunk_index, None)
            piece.cond.notify_all()
        if chunk.slot is not None:
            piece.slots.written(xfer, chunk.slot)

    def _write(self, link: _Link, piece: _OutPiece, chunk: _Outgoing, dest: dict):
        """Push: WRITE the chunk where the receiver said, with its notification; returns the WRITE."""
        index = chunk.header.chunk_index
        if dest.get("error"):
            raise TransferError(str(dest["error"]), FailedSide.RECEIVER)
        dst, header = dest.get("dst") or {}, chunk.header
        try:
            if chunk.slot is None:
                blocks = dst.get("blocks")
                if link.remote_cache is None or not isinstance(blocks, list) or len(blocks) != len(chunk.block_ids) \
                        or link.remote_cache.nbytes != chunk.cache.shape.nbytes:
                    raise ValueError("bad destination blocks")
                local, remote = paired_descriptors(chunk.cache.shape, chunk.block_ids, link.remote_cache, blocks,
                                                   (header.layer_start, header.layer_end))
                local_mem, remote_mem = chunk.cache.shape.region.mem, link.remote_cache.region.mem
            else:
                offset, length = dst.get("offset"), dst.get("length")
                if link.remote_staging is None or not isinstance(offset, int) or length != header.payload_len:
                    raise ValueError("bad destination staging slot")
                local = span_descriptor(self.staging_region, chunk.slot, length)
                remote = span_descriptor(link.remote_staging, offset, length)
                local_mem, remote_mem = self.staging_region.mem, link.remote_staging.mem
        except ValueError as exc:
            raise TransferError(f"nixl receiver sent a {exc} for chunk {index}", FailedSide.TRANSPORT) from None
        note = landed_note(link.channel.key, piece.id, index)
        try:
            return self.agent.post("WRITE", local, local_mem, remote, remote_mem, link.peer_agent, note)
        except RuntimeError as exc:
            raise TransferError(str(exc), FailedSide.TRANSPORT) from None

    def _wait_writes(self, writes: list, deadline_at: float) -> None:
        """Push: every WRITE done (its bytes landed) before the piece's end."""
        while True:
            states = [self.agent.state(xfer) for xfer in writes]
            if "ERR" in states:
                raise TransferError("nixl WRITE failed (the receiver went away?)", FailedSide.TRANSPORT)
            if all(state == "DONE" for state in states):
                return
            if time.monotonic() > deadline_at:
                raise TransferError("deadline passed before the nixl WRITEs completed", FailedSide.TRANSPORT,
                                    TransferStatus.EXPIRED)
            time.sleep(WRITE_POLL_S)

    def _abort(self, link: _Link, piece: _OutPiece, reason: str) -> None:
        """Tell the receiver to drop the piece; push: once none of its WRITEs can land any more (the receiver
        holds their blocks until then), so a WRITE still under way hands the message to a thread that waits."""
        with piece.cond:
            piece.closed = True
            writes = list(piece.writes)
        unsettled = [xfer for xfer in writes if self.agent.state(xfer) == "PROC"]

        def send() -> None:
            while any(self.agent.state(xfer) == "PROC" for xfer in unsettled):
                time.sleep(WRITE_POLL_S * 10)
            for xfer in unsettled:
                self.agent.release(xfer)
            try:
                link.send({"kind": "abort", "piece": piece.id, "reason": reason[:1000]})
            except TransferError:
                pass

        if unsettled:  # the thread releases them
            threading.Thread(target=send, name="kv-nixl-settle", daemon=True).start()
        else:
            send()

    def close(self) -> None:
        super().close()
        with self._links_lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        self.agent.close()

