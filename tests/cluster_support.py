"""A running pdserve cluster for sync tests (importable from every test folder: tests/ is on sys.path)."""
from __future__ import annotations

import threading


class ClusterThread:
    """A running cluster on its own event loop thread, for sync tests with plain gRPC clients."""

    def __init__(self, cfg, **start):
        """start: more `deploy.running.start_cluster` arguments (e.g. mode="colocated")."""
        import asyncio

        from deploy.running import start_cluster
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.cluster = self.call(start_cluster(cfg, port=0, **start))
        assert self.call(self.cluster.server.wait_ready(60)), "cluster never became ready"
        self.address = self.cluster.address

    def call(self, coro, timeout: float = 120.0):
        import asyncio
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.cluster.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
