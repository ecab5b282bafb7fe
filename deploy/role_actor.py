"""An actor whose role can change at run time: one engine (weights, paged KV cache) serving as a
prefill, decode or colocated worker, switched by `set_role` without restarting the process.

The launcher starts these instead of the fixed-role actors when ``routing.role_flips`` is manual or auto. A flip,
as the pool manager runs it (`deploy.pool_manager.PoolManager.flip`):

    router: the actor leaves its pool (no new work of the old role), its in-flight requests end
      → set_role(new): wait until the worker holds nothing (decode requests finish, prefill sends
        complete); past `timeout_s` hand off what is left (decode requests get a retryable error
        and the router migrates them; queued prefills are aborted and the router retries them)
      → stop the old worker (its loop, KV receiver or sender; parked KV is freed), check that no
        KV block is held, set the scheduler's limits of the new role, start the new worker over
        the same engine (a decode role opens a new KV receiver endpoint)
    router: a fresh view of the actor joins the new role's pool (`info()` gives its endpoints)

The actor's id and incarnation do not change (the process is the same); its role is in
`info()` and `stats()`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import logging
import os
import time
import uuid

import grpc

from decode_worker.colocated import ColocatedWorker, error_event
from decode_worker.stream_service import DecodeStreamServer
from decode_worker.worker import DecodeWorker
from engine.args import EngineArgs
from kv_transfer import TransferSettings, codec_compiled, get_codec, layout_of, make_receiver, make_sender
from kv_transfer import release_gil_in_compiled_kernels
from proto.internal_auth import InternalTLS
from prefill_worker.worker import PrefillWorker
from proto.pdserve.v1 import worker_pb2 as wpb

log = logging.getLogger(f"pdserve.{__name__}")

ROLES = ("prefill", "decode", "colocated")
CODEC_BUILD_TIMEOUT_S = 300.0
IDLE_POLL_S = 0.02


@dataclasses.dataclass(slots=True, frozen=True)
class RoleLimits:
    """The scheduler's limits in one role (pools.yaml: the prefill or decode pool's batch policy)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    chunk_size: int | None


class RoleActor:
    """Async actor: the union of the prefill and decode actors' calls, plus `set_role`."""

    def __init__(self, engine_args: EngineArgs, transfer: TransferSettings, actor_id: str, stream_token: str,
                 role: str, limits: dict[str, RoleLimits], bind_host: str = "127.0.0.1",
                 tls: InternalTLS | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if "auto" in (bind_host, transfer.bind_host):   # multi-node: this node's address
            import ray
            node_ip = ray.util.get_node_ip_address()
            bind_host = node_ip if bind_host == "auto" else bind_host
            if transfer.bind_host == "auto":
                transfer = dataclasses.replace(transfer, bind_host=node_ip)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        faulthandler.enable()    # a native crash leaves its traceback in the log (deploy/actor_death.py)
        self.actor_id, self.transfer, self.limits = actor_id, transfer, limits
        self.incarnation = uuid.uuid4().hex
        release_gil_in_compiled_kernels()
        self.engine = engine_args.build()
        self.layout = layout_of(self.engine.kv_cache, self.engine.fingerprint)
        get_codec(transfer.codec).prepare(self.engine.kv_cache)     # both sides' kernels, once
        if not codec_compiled.wait_ready(CODEC_BUILD_TIMEOUT_S):
            log.warning("fp8 codec kernels not built within %.0fs; the eager codec meanwhile", CODEC_BUILD_TIMEOUT_S)
        self.role = role
        self.worker = self._make_worker(role)
        self.worker.start()
        self.stream = DecodeStreamServer(_StreamTarget(self), stream_token, bind_host, tls=tls)
        self._flipping = asyncio.Lock()
        self.num_flips = 0
        log.info("%s actor %s ready (role flips on): model %s, %d KV blocks", role, actor_id,
                 self.engine.model_dir, self.engine.block_manager.num_blocks)

    # ---- the role's worker ------------------------------------------------
    def _make_worker(self, role: str):
        limits = self.limits[role]
        sched = self.engine.scheduler
        sched.max_num_seqs, sched.max_num_batched_tokens = limits.max_num_seqs, limits.max_num_batched_tokens
        sched.chunk_size = limits.chunk_size
        engine, layout = self.engine, self.layout
        if role == "prefill":
            return PrefillWorker(engine, make_sender(self.transfer, layout, engine.device), self.actor_id,
                                 layerwise=self.transfer.layerwise)
        if role == "decode":
            return DecodeWorker(engine, lambda on_complete: make_receiver(
                self.transfer, layout, engine.kv_cache, engine.block_manager, on_complete), self.actor_id)
        return ColocatedWorker(engine, self.actor_id)

    async def set_role(self, role: str, timeout_s: float = 30.0) -> dict:
        """Switch to `role` in place (see the module docstring); returns the new `info()`.

        Raises:
            ValueError: an unknown role.
            RuntimeError: KV blocks still held after the old worker stopped (nothing is started then).
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        async with self._flipping:
            if role == self.role:
                return await self.info()
            start = time.monotonic()
            old, old_role = self.worker, self.role
            handed_off = 0
            if not await self._wait_idle(old, start + timeout_s):
                handed_off = await old.loop.run_async(lambda: self._hand_off(old))
                await self._wait_idle(old, time.monotonic() + 5.0)
            old.stop()
            used = self.engine.block_manager.num_used_blocks
            if self.engine.requests or used:
                raise RuntimeError(f"{self.actor_id}: {len(self.engine.requests)} requests and {used} KV blocks "
                                   f"still held after the {old_role} worker stopped")
            self.worker = self._make_worker(role)
            self.role = role
            self.worker.start()
            self.num_flips += 1
            log.info("actor %s flipped %s -> %s in %.2fs (%d requests handed off)", self.actor_id, old_role, role,
                     time.monotonic() - start, handed_off)
            return {**await self.info(), "handed_off": handed_off}

    async def _wait_idle(self, worker, deadline: float) -> bool:
        """Until the worker holds no request (read on its loop thread), or `deadline`."""
        while True:
            if await worker.loop.run_async(lambda: not self.engine.requests and _holds_nothing(worker)):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(IDLE_POLL_S)

    def _hand_off(self, worker) -> int:
        """Loop thread: give up the work left (decode: retryable errors, the router migrates; prefill:
        aborted, the router retries elsewhere)."""
        if isinstance(worker, PrefillWorker):
            request_ids = list(self.engine.requests)
            for rid in request_ids:
                worker.abort(rid)            # runs on this loop before the next idle check
            return len(request_ids)
        return worker.evict("the actor is changing role")

    # ---- calls of every role ----------------------------------------------
    async def prefill(self, job_bytes: bytes) -> bytes:
        job = wpb.PrefillJob.FromString(job_bytes)
        worker = self.worker
        if not isinstance(worker, PrefillWorker):       # flipped away: the router retries elsewhere
            return wpb.PrefillResult(request_id=job.request_id, transfer_id=job.transfer_id,
                                     status=wpb.PREFILL_STATUS_FAILED, failed_side=wpb.TRANSFER_SIDE_SENDER,
                                     retryable=True, error=f"{self.actor_id} is a {self.role} actor now"
                                     ).SerializeToString()
        return (await worker.prefill(job)).SerializeToString()

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def stats(self) -> dict:
        return self.stream.add_refusals(self.worker.stats())

    async def info(self) -> dict:
        if not self.stream.endpoint:        # first call, in the actor's event loop
            await self.stream.start()
        decodes = self.role != "prefill"
        return {"role": self.role, "actor_id": self.actor_id, "incarnation": self.incarnation, "pid": os.getpid(),
                "endpoint": self.worker.endpoint if decodes else "",
                "stream_endpoint": self.stream.endpoint, "layout": self.layout.describe(self.transfer.codec),
                "kv_blocks_total": self.engine.block_manager.num_blocks, "block_size": self.engine.block_size,
                "max_model_len": self.engine.max_model_len, "num_flips": self.num_flips}

    async def ping(self) -> bool:
        return True

    async def kv_events(self, request_bytes: bytes) -> bytes:
        """A serialized `KVEventsRequest` in, the engine's `KVEventsResponse` out: the prefix cache is the
        engine's, so its events and sequence numbers run on across flips."""
        return self.engine.kv_events.answer_bytes(request_bytes)

    async def cached_prefix(self, query: bytes) -> bytes:
        """A serialized `PrefixQuery` → `PrefixHits`: the leading prompt blocks this actor's cache holds."""
        hits = self.engine.cached_prefix_blocks(list(wpb.PrefixQuery.FromString(query).block_hashes))
        return wpb.PrefixHits(num_cached_blocks=hits).SerializeToString()

    async def profile(self, spec: dict) -> dict | None:
        from engine.profile import run_point
        return await self.worker.loop.run_async(lambda: run_point(self.engine, spec))


def _holds_nothing(worker) -> bool:
    """No request queued, running, waiting for KV, or sending KV on this worker (loop thread)."""
    stats = worker.stats()
    return stats["queued_requests"] == 0 and stats["running_requests"] == 0


class _StreamTarget:
    """What the token stream submits to: the current worker when it decodes, else a refusal that the
    router retries on another decode actor."""

    def __init__(self, actor: RoleActor):
        self.actor = actor

    @property
    def engine(self):
        return self.actor.engine

    def submit(self, job: wpb.DecodeJob, emit) -> None:
        worker = self.actor.worker
        if isinstance(worker, ColocatedWorker):
            worker.submit(job, emit)
            return
        emit(error_event(grpc.StatusCode.UNAVAILABLE, f"{self.actor.actor_id} is a prefill actor now", True))

    def abort(self, request_id: str) -> None:
        worker = self.actor.worker
        if isinstance(worker, ColocatedWorker):
            worker.abort(request_id)
