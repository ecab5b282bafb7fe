"""Ray actor around `DecodeWorker`; tokens stream to the router over `DecodeStreamServer` (gRPC)."""
from __future__ import annotations

import dataclasses
import logging
import os
import uuid

from decode_worker.stream_service import DecodeStreamServer
from decode_worker.worker import DecodeWorker
from engine.args import EngineArgs
from kv_transfer.codec_compiled import release_gil_in_compiled_kernels
from kv_transfer.settings import TransferSettings, build_receiver, layout_of

log = logging.getLogger(f"pdserve.{__name__}")


class DecodeActor:
    def __init__(self, engine_args: EngineArgs, transfer: TransferSettings | None, actor_id: str,
                 stream_token: str, bind_host: str = "127.0.0.1"):
        """transfer None: a colocated actor (no KV receiver; prefills every request itself).
        stream_token: the cluster token the router presents on the token stream."""
        if "auto" in (bind_host, transfer.bind_host if transfer else ""):   # multi-node: this node's address
            import ray
            node_ip = ray.util.get_node_ip_address()
            bind_host = node_ip if bind_host == "auto" else bind_host
            if transfer is not None and transfer.bind_host == "auto":
                transfer = dataclasses.replace(transfer, bind_host=node_ip)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.incarnation = uuid.uuid4().hex     # changes when Ray restarts the actor
        release_gil_in_compiled_kernels()  # compiled CPU kernels then leave the other threads running
        engine = engine_args.build()
        self.layout = layout_of(engine.kv_cache, engine.fingerprint)
        self.transfer = transfer
        make_receiver = None if transfer is None else (lambda on_complete: build_receiver(
            transfer, self.layout, engine.kv_cache, engine.block_manager, on_complete))
        self.worker = DecodeWorker(engine, make_receiver, actor_id, role="decode" if transfer else "colocated")
        self.worker.start()
        self.stream = DecodeStreamServer(self.worker, stream_token, bind_host)
        log.info("decode actor %s ready: model %s, %d KV blocks, KV endpoint %s", actor_id,
                 engine.model_dir, engine.block_manager.num_blocks, self.worker.endpoint)

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def stats(self) -> dict:
        return self.worker.stats()

    async def info(self) -> dict:
        if not self.stream.endpoint:        # first call, in the actor's event loop
            await self.stream.start()
        engine = self.worker.engine
        return {"role": self.worker.role, "actor_id": self.worker.actor_id, "incarnation": self.incarnation,
                "pid": os.getpid(), "endpoint": self.worker.endpoint, "stream_endpoint": self.stream.endpoint,
                "layout": self.layout.describe(self.transfer.codec if self.transfer else "none"),
                "kv_blocks_total": engine.block_manager.num_blocks, "block_size": engine.block_size,
                "max_model_len": engine.max_model_len}

    async def profile(self, spec: dict) -> dict | None:
        """One `engine.profile` measurement (see `run_point`), run on the engine loop thread
        between steps so it never races the loop."""
        from engine.profile import run_point
        return await self.worker.loop.run_async(lambda: run_point(self.worker.engine, spec))
