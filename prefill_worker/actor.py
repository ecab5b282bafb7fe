"""Ray actor around `PrefillWorker` (deploy applies `ray.remote` to it).

Its calls take and return serialized `pdserve.v1` worker messages (bytes), so
nothing the router and the actor exchange is pickled.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import uuid

from engine.args import EngineArgs
from kv_transfer import TransferSettings, codec_compiled, get_codec, layout_of, make_sender
from kv_transfer import release_gil_in_compiled_kernels
from prefill_worker.worker import PrefillWorker
from proto.pdserve.v1 import worker_pb2 as wpb

log = logging.getLogger(f"pdserve.{__name__}")

CODEC_BUILD_TIMEOUT_S = 300.0   # longest wait at start for the KV codec's compiled kernels


class PrefillActor:
    """Async actor: `prefill` awaits the worker's result without blocking other calls."""

    def __init__(self, engine_args: EngineArgs, transfer: TransferSettings, actor_id: str):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        faulthandler.enable()    # a native crash leaves its traceback in the log (deploy/actor_death.py)
        self.incarnation = uuid.uuid4().hex     # changes when Ray restarts the actor
        release_gil_in_compiled_kernels()  # compiled CPU kernels then leave the other threads running
        engine = engine_args.build()
        self.layout = layout_of(engine.kv_cache, engine.fingerprint)
        self.transfer = transfer
        self.worker = PrefillWorker(engine, make_sender(transfer, self.layout, engine.device), actor_id,
                                    layerwise=transfer.layerwise)
        # The codec's compiled kernels are built (or loaded from the disk cache) now, before serving: the
        # first transfers then run the fast codec, and no build competes with requests for a core.
        get_codec(transfer.codec).prepare(engine.kv_cache)
        if not codec_compiled.wait_ready(CODEC_BUILD_TIMEOUT_S):
            log.warning("fp8 codec kernels not built within %.0fs; encoding with the eager codec meanwhile",
                        CODEC_BUILD_TIMEOUT_S)
        self.worker.start()
        log.info("prefill actor %s ready: model %s, %d KV blocks, transport %s/%s%s", actor_id,
                 engine.model_dir, engine.block_manager.num_blocks, transfer.transport, transfer.codec,
                 ", layer-wise" if transfer.layerwise else "")

    async def prefill(self, job_bytes: bytes) -> bytes:
        """A serialized `PrefillJob` in, its serialized `PrefillResult` out."""
        return (await self.worker.prefill(wpb.PrefillJob.FromString(job_bytes))).SerializeToString()

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def stats(self) -> dict:
        return self.worker.stats()

    async def kv_events(self, request_bytes: bytes) -> bytes:
        """A serialized `KVEventsRequest` in, the engine's `KVEventsResponse` out (engine.kv_events)."""
        return self.worker.engine.kv_events.answer_bytes(request_bytes)

    async def info(self) -> dict:
        engine = self.worker.engine
        return {"role": "prefill", "actor_id": self.worker.actor_id, "incarnation": self.incarnation,
                "pid": os.getpid(), "layout": self.layout.describe(self.transfer.codec),
                "kv_blocks_total": engine.block_manager.num_blocks, "block_size": engine.block_size,
                "max_model_len": engine.max_model_len}

    async def ping(self) -> bool:
        return True

    async def set_fault(self, kind: str | None, seconds: float = 0.0) -> None:
        """Failure drills: "corrupt" or "stall" this actor's outgoing KV chunks; None to stop."""
        from prefill_worker.faults import set_fault
        set_fault(self.worker.sender, kind, seconds)

    async def profile(self, spec: dict) -> dict | None:
        """One `engine.profile` measurement (see `run_point`), run on the engine loop thread
        between steps so it never races the loop."""
        from engine.profile import run_point
        return await self.worker.loop.run_async(lambda: run_point(self.worker.engine, spec))
