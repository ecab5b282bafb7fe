"""Ray actors around `DecodeWorker` and `ColocatedWorker` (deploy applies `ray.remote` to them).

Tokens stream to the router over `DecodeStreamServer` (gRPC, worker.proto), started
in the actor's event loop by the first `info()` call.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import uuid

from decode_worker import faults
from decode_worker.colocated import ColocatedWorker
from decode_worker.stream_service import DecodeStreamServer
from decode_worker.worker import DecodeWorker
from engine.args import EngineArgs
from kv_transfer import TransferSettings, codec_compiled, layout_of, make_receiver, release_gil_in_compiled_kernels
from proto.internal_auth import InternalTLS
from proto.pdserve.v1 import worker_pb2 as wpb

log = logging.getLogger(f"pdserve.{__name__}")

CODEC_BUILD_TIMEOUT_S = 300.0   # longest wait at start for the KV codec's compiled kernels


class ColocatedActor:
    """A colocated engine: prefills and decodes every request itself (the baseline)."""

    def __init__(self, engine_args: EngineArgs, actor_id: str, stream_token: str, bind_host: str = "127.0.0.1",
                 tls: InternalTLS | None = None):
        """stream_token: the internal secret the router presents on the token stream; tls: the
        node's internal certificates (set = the stream speaks mutual TLS only)."""
        if bind_host == "auto":                  # multi-node: this node's address
            import ray
            bind_host = ray.util.get_node_ip_address()
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        faulthandler.enable()    # a native crash leaves its traceback in the log (deploy/actor_death.py)
        self.incarnation = uuid.uuid4().hex     # changes when Ray restarts the actor
        release_gil_in_compiled_kernels()  # compiled CPU kernels then leave the other threads running
        engine = engine_args.build()
        self.layout = layout_of(engine.kv_cache, engine.fingerprint)
        self.codec = "none"
        self.worker = self._make_worker(engine, actor_id)
        self.worker.start()
        self.stream = DecodeStreamServer(self.worker, stream_token, bind_host, tls=tls)
        log.info("%s actor %s ready: model %s, %d KV blocks", self.worker.role, actor_id, engine.model_dir,
                 engine.block_manager.num_blocks)

    def _make_worker(self, engine, actor_id: str) -> ColocatedWorker:
        return ColocatedWorker(engine, actor_id)

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def stats(self) -> dict:
        return self.stream.add_refusals(self.worker.stats())

    async def kv_events(self, request_bytes: bytes) -> bytes:
        """A serialized `KVEventsRequest` in, the engine's `KVEventsResponse` out (engine.kv_events)."""
        return self.worker.engine.kv_events.answer_bytes(request_bytes)

    async def info(self) -> dict:
        if not self.stream.endpoint:        # first call, in the actor's event loop
            await self.stream.start()
        engine = self.worker.engine
        return {"role": self.worker.role, "actor_id": self.worker.actor_id, "incarnation": self.incarnation,
                "pid": os.getpid(), "endpoint": self.worker.endpoint,
                "stream_endpoint": self.stream.endpoint, "layout": self.layout.describe(self.codec),
                "kv_blocks_total": engine.block_manager.num_blocks, "block_size": engine.block_size,
                "max_model_len": engine.max_model_len}

    async def cached_prefix(self, query: bytes) -> bytes:
        """A serialized `PrefixQuery` → `PrefixHits`: the leading prompt blocks this actor's cache holds."""
        return self.worker.cached_prefix(wpb.PrefixQuery.FromString(query)).SerializeToString()

    async def profile(self, spec: dict) -> dict | None:
        """One `engine.profile` measurement (see `run_point`), run on the engine loop thread
        between steps so it never races the loop."""
        from engine.profile import run_point
        return await self.worker.loop.run_async(lambda: run_point(self.worker.engine, spec))

    async def set_fault(self, kind: str | None, seconds: float = 0.0) -> None:
        """Failure drills: "hang" stops this actor's engine loop for `seconds`; None ends it."""
        faults.set_fault(self.worker, kind, seconds)


class DecodeActor(ColocatedActor):
    """A decode actor: receives each request's KV from a prefill actor, then decodes it."""

    def __init__(self, engine_args: EngineArgs, transfer: TransferSettings, actor_id: str, stream_token: str,
                 bind_host: str = "127.0.0.1"):
        if "auto" in (bind_host, transfer.bind_host):   # multi-node: this node's address
            import ray
            node_ip = ray.util.get_node_ip_address()
            bind_host = node_ip if bind_host == "auto" else bind_host
            if transfer.bind_host == "auto":
                transfer = dataclasses.replace(transfer, bind_host=node_ip)
        self.transfer = transfer
        super().__init__(engine_args, actor_id, stream_token, bind_host, transfer.tls)
        self.codec = transfer.codec

    def _make_worker(self, engine, actor_id: str) -> DecodeWorker:
        worker = DecodeWorker(engine, lambda on_complete: make_receiver(
            self.transfer, self.layout, engine.kv_cache, engine.block_manager, on_complete), actor_id)
        # The receiver started building the codec's compiled kernels: finish before serving (a build left
        # to run under the first requests would take a core from them).
        if not codec_compiled.wait_ready(CODEC_BUILD_TIMEOUT_S):
            log.warning("fp8 codec kernels not built within %.0fs; decoding with the eager codec meanwhile",
                        CODEC_BUILD_TIMEOUT_S)
        return worker
