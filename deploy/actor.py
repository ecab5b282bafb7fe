"""The one Ray actor class of pdserve: an engine (weights, paged KV cache) serving in a role.

`ActorFactory.spawn` (deploy/launcher.py) applies `ray.remote` to `ServingActor`; the plain workers it
wraps by composition (`PrefillWorker`, `DecodeWorker`, `ColocatedWorker`) know nothing of Ray. Its
calls take and return serialized `pdserve.v1` worker messages (bytes), so nothing the router and the
actor exchange is pickled; decode and colocated roles stream tokens over `DecodeStreamServer` (gRPC,
worker.proto), started in the actor's event loop by the first `info()` call.

Set-up, the same for every role: logging, `faulthandler` (a native crash leaves its traceback in the
log: deploy/actor_death.py), a fresh incarnation (it changes when Ray restarts the actor), compiled CPU
kernels that release the GIL, the engine, the KV codec's compiled kernels (built or loaded from the
disk cache before serving, so no build competes with the first requests for a core), the role's worker.

Roles (`ROLES`): ``prefill`` (batched, chunked prefill; ships KV to decode actors), ``decode`` (adopts KV,
continuous batching; prefills locally the jobs that name no transfer) and ``colocated`` (prefills and
decodes every request itself). Started with `limits` (``routing.role_flips`` manual or auto), the
actor can change role at run time; a flip, as the pool manager runs it
(`deploy.pool_manager.PoolManager.flip`):

    router: the actor leaves its pool (no new work of the old role), its in-flight requests end
      → set_role(new) runs `deploy.role_change.change_role`: wait until the worker holds nothing
        (decode requests finish, prefill sends complete); past `timeout_s` hand off what is left
        (decode requests get a retryable error and the router migrates them; queued prefills are
        aborted and the router retries them)
      → stop the old worker (its loop, KV receiver or sender; parked KV is freed), check that no
        KV block is held, set the scheduler's limits of the new role, start the new worker over
        the same engine (a decode role opens a new KV receiver endpoint)
    router: a fresh view of the actor joins the new role's pool (`info()` gives its endpoints)

The actor's id and incarnation do not change across flips (the process is the same); its role is in
`info()` and `stats()`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import logging
import os
import uuid

import grpc

from decode_worker.colocated import ColocatedWorker
from decode_worker.stream_service import DecodeStreamServer
from decode_worker.streams import error_event
from decode_worker.worker import DecodeWorker
from deploy.rank_kv import RemoteReceiver, RemoteSender
from deploy.role_change import change_role
from engine import Engine, EngineArgs
from engine.parallel.reshard import reshard_plan
from engine.parallel.shard import kv_head_ranges
from kv_transfer import TransferSettings, codec_compiled, get_codec, layout_of, make_receiver, make_sender
from kv_transfer import release_gil_in_compiled_kernels
from kv_transfer.resharded import ReshardedReceiver, ReshardedSender, head_view
from prefill_worker.worker import PrefillWorker
from proto.internal_auth import InternalTLS
from proto.pdserve.v1 import worker_pb2 as wpb
from router.roles import ROLE_OF_NAME, role_named

log = logging.getLogger(f"pdserve.{__name__}")

ROLES = tuple(ROLE_OF_NAME)  # the roles by name, as the actor's calls take them
CODEC_BUILD_TIMEOUT_S = 300.0   # longest wait at start for the KV codec's compiled kernels


@dataclasses.dataclass(slots=True, frozen=True)
class RoleLimits:
    """The scheduler's limits in one role (pools.yaml: the prefill or decode pool's batch policy)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    chunk_size: int | None


class ServingActor:
    """Async actor: one engine and the worker of its current role.

    Calls (every role answers each): `prefill` (a prefill role's; any other answers a retryable
    failure), `abort`, `stats`, `info`, `ping`, `kv_events`, `cached_prefix`, `profile`, `set_fault`,
    `set_role` (only when started with `limits`).
    """

    def __init__(self, engine_args: EngineArgs, actor_id: str, role: str, *,
                 transfer: TransferSettings | None = None, stream_token: str = "", bind_host: str = "127.0.0.1",
                 tls: InternalTLS | None = None, limits: dict[str, RoleLimits] | None = None,
                 ranks: list | None = None, kv_degrees: tuple[int, int] | None = None):
        """
        Args:
            engine_args: the engine to build (its scheduler limits are the starting role's unless
                `limits` is given).
            actor_id: this actor's name in the router's pools and logs.
            role: one of `ROLES`.
            transfer: the KV transfer settings; needed by the prefill and decode roles and by a
                role-flippable actor (None: a colocated actor, whose layout then names no codec).
            stream_token: the internal secret the router presents on the token stream.
            bind_host: where the token stream (and the KV receiver, when ``transfer.bind_host`` is
                "auto") listens; "auto" = this node's address (multi-node).
            tls: the node's internal certificates (set = the token stream speaks mutual TLS only).
            limits: the scheduler limits of each role; given, the actor can change role (`set_role`).
            ranks: the `RankActor` handles of ranks 1.. of a tensor-parallel actor (this actor is rank 0).
            kv_degrees: (prefill, decode) tensor-parallel degrees of the cluster when either is above 1: KV
                then travels resharded by head (kv_transfer/resharded.py), from the prefill degree.
        """
        role_named(role)  # ValueError naming the roles
        if transfer is None and (role != "colocated" or limits is not None):
            raise ValueError(f"a {role} actor{' with role flips' if limits else ''} needs transfer settings")
        if "auto" in (bind_host, transfer.bind_host if transfer else None):   # multi-node: this node's address
            import ray
            node_ip = ray.util.get_node_ip_address()
            bind_host = node_ip if bind_host == "auto" else bind_host
            if transfer is not None and transfer.bind_host == "auto":
                transfer = dataclasses.replace(transfer, bind_host=node_ip)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        faulthandler.enable()    # a native crash leaves its traceback in the log (deploy/actor_death.py)
        self.actor_id, self.transfer, self.limits = actor_id, transfer, limits
        self.ranks, self.kv_degrees, self.resharded = list(ranks or []), kv_degrees, None
        self.incarnation = uuid.uuid4().hex     # changes when Ray restarts the actor
        release_gil_in_compiled_kernels()       # compiled CPU kernels then leave the other threads running
        self.engine = Engine(engine_args)
        engine = self.engine
        self.layout = layout_of(engine.kv_cache, engine.fingerprint, engine.kv_format, engine.tp.shard)
        self.codec = transfer.codec if transfer is not None else "none"
        if transfer is not None:
            get_codec(transfer.codec).prepare(self.engine.kv_cache)     # both sides' kernels, once
            if not codec_compiled.wait_ready(CODEC_BUILD_TIMEOUT_S):
                log.warning("fp8 codec kernels not built within %.0fs; the eager codec meanwhile",
                            CODEC_BUILD_TIMEOUT_S)
        self.role = role
        self.worker = self._make_worker(role)
        self.worker.start()
        self.stream = DecodeStreamServer(_StreamTarget(self), stream_token, bind_host, tls=tls)
        self._flipping = asyncio.Lock()
        self.num_flips = 0
        shipping = f", transport {transfer.transport}/{transfer.codec}" if transfer is not None else ""
        log.info("%s actor %s ready%s: model %s, %d KV blocks%s%s", role, actor_id,
                 " (role flips on)" if limits else "", self.engine.model_dir, self.engine.block_manager.num_blocks,
                 shipping, ", layer-wise" if role == "prefill" and transfer.layerwise else "")

    # ---- the role's worker ------------------------------------------------
    def _make_worker(self, role: str) -> PrefillWorker | DecodeWorker | ColocatedWorker:
        engine, layout, transfer = self.engine, self.layout, self.transfer
        if self.limits is not None:
            limits = self.limits[role]
            sched = engine.scheduler
            sched.max_num_seqs, sched.max_num_batched_tokens = limits.max_num_seqs, limits.max_num_batched_tokens
            sched.chunk_size = limits.chunk_size
        if role == "prefill":
            sender = (self._resharded_sender() if self.kv_degrees else
                      make_sender(transfer, layout, engine.device, kv_cache=engine.kv_cache))
            return PrefillWorker(engine, sender, self.actor_id, layerwise=transfer.layerwise)
        if role == "decode":
            if self.kv_degrees:
                return DecodeWorker(engine, self._resharded_receiver, self.actor_id)
            return DecodeWorker(engine, lambda on_complete: make_receiver(
                transfer, layout, engine.kv_cache, engine.block_manager, on_complete), self.actor_id)
        return ColocatedWorker(engine, self.actor_id)

    # ---- KV resharded between tensor-parallel degrees (kv_transfer/resharded.py, deploy/rank_kv.py) ----
    def _rank_layouts(self) -> list:
        ranges = kv_head_ranges(self.engine.config, self.engine.tp.size)
        return [dataclasses.replace(self.layout, num_kv_heads=len(r), kv_head_start=r.start) for r in ranges]

    def _resharded_sender(self) -> ReshardedSender:
        engine, transfer = self.engine, self.transfer

        def member(rank: int, heads: range, layout):
            if rank == 0:
                return make_sender(transfer, layout, engine.device)
            return RemoteSender(self.ranks[rank - 1], transfer, layout, heads)
        log.info("prefill actor %s: KV resharded by head from its %d ranks", self.actor_id, engine.tp.size)
        return ReshardedSender(self._rank_layouts(), [engine.kv_cache] + [None] * len(self.ranks), member)

    def _resharded_receiver(self, on_complete) -> ReshardedReceiver:
        import ray
        engine, transfer = self.engine, self.transfer
        source, me = self.kv_degrees[0], ray.get_runtime_context().current_actor if self.ranks else None

        def member(copy, layout, blocks, done):
            if copy.dest_rank == 0:
                view = head_view(engine.kv_cache, copy.dest_heads, layout)
                return make_receiver(transfer, layout, view, blocks, done)
            rank, key = self.ranks[copy.dest_rank - 1], uuid.uuid4().hex
            endpoint = ray.get(rank.open_copy.remote(key, transfer, layout, copy.dest_heads, me))
            return RemoteReceiver(rank, key, endpoint)
        self.resharded = ReshardedReceiver.open(
            reshard_plan(engine.config, source, engine.tp.size), source, self._rank_layouts(), engine.block_manager,
            member, on_complete, deadline_s=transfer.deadline_s, codec=transfer.codec)
        log.info("decode actor %s: KV resharded by head from tensor_parallel %d: %d copy receivers on %d ranks",
                 self.actor_id, source, len(self.resharded.members), engine.tp.size)
        return self.resharded

    async def allocate_transfer(self, transfer_id: str, num_blocks: int) -> list[int] | None:
        """Another rank's copy receiver reserves a transfer's blocks (the ids every rank writes)."""
        return self.resharded.blocks.allocate_transfer(transfer_id, num_blocks)

    async def free_transfer(self, transfer_id: str) -> None:
        self.resharded.blocks.free_transfer(transfer_id, [])

    async def copy_done(self, result) -> None:
        """Another rank's copy receiver ended a transfer (handled on a thread: it may cancel other copies)."""
        await asyncio.to_thread(self.resharded.member_done, result)

    async def set_role(self, role: str, timeout_s: float = 30.0) -> dict:
        """Switch to `role` in place (see the module docstring); returns the new `info()`.

        Raises:
            ValueError: an unknown role.
            RuntimeError: the actor was started without role flips, or KV blocks are still held after
                the old worker stopped (nothing is started then).
        """
        role_named(role)  # ValueError naming the roles
        if self.limits is None:
            raise RuntimeError(f"{self.actor_id} cannot change role (start the cluster with routing.role_flips: "
                               "manual or auto)")
        async with self._flipping:
            if role == self.role:
                return await self.info()
            handed_off = await change_role(self, role, timeout_s, self._make_worker)
            self.num_flips += 1
            return {**await self.info(), "handed_off": handed_off}

    # ---- calls of every role ----------------------------------------------
    async def prefill(self, job_bytes: bytes) -> bytes:
        """A serialized `PrefillJob` in, its serialized `PrefillResult` out (awaited without blocking
        other calls)."""
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
        stats = self.worker.stats()
        return self.stream.add_refusals(stats) if self._streams_tokens() else stats

    async def info(self) -> dict:
        if not self.stream.endpoint and self._streams_tokens():     # first call, in the actor's event loop
            await self.stream.start()
        decodes = self.role != "prefill"
        return {"role": self.role, "actor_id": self.actor_id, "incarnation": self.incarnation, "pid": os.getpid(),
                "endpoint": self.worker.endpoint if decodes else "",
                "stream_endpoint": self.stream.endpoint, "layout": self.layout.describe(self.codec),
                "kv_blocks_total": self.engine.block_manager.num_blocks, "block_size": self.engine.block_size,
                "max_model_len": self.engine.max_model_len, "num_flips": self.num_flips,
                "quantization": self.engine.quantization, "kv_cache_dtype": self.engine.kv_format.kind}

    def _streams_tokens(self) -> bool:
        """A decode or colocated role, now or after a flip, streams tokens: a fixed prefill actor never does."""
        return self.role != "prefill" or self.limits is not None

    async def ping(self) -> bool:
        return True

    async def kv_events(self, request_bytes: bytes) -> bytes:
        """A serialized `KVEventsRequest` in, the engine's `KVEventsResponse` out (engine.kv_cache.events):
        the prefix cache is the engine's, so its events and sequence numbers run on across flips."""
        return self.engine.kv_events.answer_bytes(request_bytes)

    async def cached_prefix(self, query: bytes) -> bytes:
        """A serialized `PrefixQuery` → `PrefixHits`: the leading prompt blocks this actor's cache holds."""
        hits = self.engine.cached_prefix_blocks(list(wpb.PrefixQuery.FromString(query).block_hashes))
        return wpb.PrefixHits(num_cached_blocks=hits).SerializeToString()

    async def profile(self, spec: dict) -> dict | None:
        """One `engine.profile` measurement (see `run_point`), run on the engine loop thread
        between steps so it never races the loop."""
        from engine.profile import run_point
        return await self.worker.loop.run_async(lambda: run_point(self.engine, spec))

    async def set_fault(self, kind: str | None, seconds: float = 0.0) -> None:
        """Failure drills (None ends one): a prefill role "corrupt"s or "stall"s its outgoing KV chunks
        (prefill_worker.faults); a decode or colocated role's engine loop "hang"s for `seconds`
        (decode_worker.faults)."""
        if isinstance(self.worker, PrefillWorker):
            from prefill_worker.faults import set_fault
            set_fault(self.worker.sender, kind, seconds)
        else:
            from decode_worker.faults import set_fault
            set_fault(self.worker, kind, seconds)


def log_named(role: str) -> type[ServingActor]:
    """`ServingActor` under the name Ray prefixes its log lines with, from the first: ``(PrefillActor pid=…)``,
    ``(DecodeActor pid=…)`` or ``(ColocatedActor pid=…)`` by the role the actor starts in (Ray takes the
    class's name); the class adds nothing else."""
    return _LOG_NAMED[role]


_LOG_NAMED = {role: type(f"{role.capitalize()}Actor", (ServingActor,), {"__module__": __name__, "__slots__": ()})
              for role in ROLES}


class _StreamTarget:
    """What the token stream submits to: the current worker when it decodes, else a refusal that the
    router retries on another decode actor."""

    def __init__(self, actor: ServingActor):
        self.actor = actor

    @property
    def engine(self):
        return self.actor.engine

    def submit(self, job: wpb.DecodeJob, emit) -> None:
        worker = self.actor.worker
        if isinstance(worker, PrefillWorker):
            emit(error_event(grpc.StatusCode.UNAVAILABLE, f"{self.actor.actor_id} is a prefill actor now", True))
            return
        worker.submit(job, emit)

    def abort(self, request_id: str) -> None:
        worker = self.actor.worker
        if not isinstance(worker, PrefillWorker):
            worker.abort(request_id)
