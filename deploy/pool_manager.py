"""Pool manager: keeps every pool whole.

Every `interval_s` it asks each actor for `info()`. An actor that does not
answer is marked unhealthy (the router stops sending it work); one that Ray
restarted (`max_restarts`) answers with a new incarnation and, for decode, a
new KV endpoint, and is taken back. One that Ray reports dead for good (no
restarts left), or that has not answered for `replace_after_s`, is replaced
by a fresh actor of the same pool.
"""
from __future__ import annotations

import asyncio
import logging
import time

from deploy.launcher import ActorFactory
from router.dispatcher import Dispatcher
from router.pools import POOL_NAMES, DecodeView, PrefillView

log = logging.getLogger(f"pdserve.{__name__}")


async def add_actors(backend: Dispatcher, name: str, views: list) -> None:
    """New actors take traffic from now on."""
    backend.pools.get(name).extend(views)
    await backend.admission.notify()


async def drain_actor(backend: Dispatcher, name: str, view, timeout: float = 300.0) -> bool:
    """Stop sending `view` new requests, wait for its in-flight ones, then drop it from the pool.

    Returns True when it drained in time (the caller then kills the actor).
    """
    view.draining = True
    if isinstance(view, PrefillView):
        view.healthy = False              # pick_prefill skips it
    end = time.monotonic() + timeout
    while view.busy and time.monotonic() < end:
        await asyncio.sleep(0.05)
    if view in backend.pools.get(name):
        backend.pools.get(name).remove(view)
    return not view.busy


class PoolManager:
    def __init__(self, backend: Dispatcher, factory: ActorFactory, interval_s: float = 1.0,
                 timeout_s: float = 5.0, replace_after_s: float = 120.0):
        self.backend, self.factory = backend, factory
        self.interval_s, self.timeout_s, self.replace_after_s = interval_s, timeout_s, replace_after_s
        self._silent_since: dict[int, float] = {}
        self._owed: dict[str, int] = {}        # pool -> replacements that could not start yet (retried)
        self.replaced = 0
        self.restarted = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except Exception:                  # never let the watchdog die
                log.exception("pool manager check failed")

    async def check_once(self) -> None:
        for name, count in list(self._owed.items()):
            self._owed.pop(name)
            for _ in range(count):
                await self._spawn_replacement(name, "an earlier replacement")
        checks = [(name, view) for name in POOL_NAMES for view in list(self.backend.pools.get(name))]
        results = await asyncio.gather(*(self._info(v) for _, v in checks))
        now = time.monotonic()
        for (name, view), (info, dead) in zip(checks, results):
            if info is None:
                view.healthy = False
                since = self._silent_since.setdefault(id(view), now)
                if since == now:
                    log.warning("%s actor %s is not answering; taking it out of rotation", name, view.actor_id)
                if dead or now - since >= self.replace_after_s:
                    await self._replace(name, view)
                continue
            self._silent_since.pop(id(view), None)
            if info["incarnation"] != view.incarnation:
                view.incarnation = info["incarnation"]
                if isinstance(view, DecodeView):
                    view.endpoint = info["endpoint"]
                    await view.client.moved(info["stream_endpoint"])
                self.restarted += 1
                log.info("%s actor %s restarted by Ray; back in rotation", name, view.actor_id)
            if not view.draining:
                view.healthy = True
        await self.backend.admission.notify()

    async def _info(self, view) -> tuple[dict | None, bool]:
        """(info, dead for good): a restarting actor is silent but not dead."""
        import ray
        try:
            return await asyncio.wait_for(view.client.handle.info.remote(), self.timeout_s), False
        except ray.exceptions.ActorDiedError:
            return None, True
        except Exception:
            return None, False

    async def _replace(self, name: str, view) -> None:
        import ray
        self._silent_since.pop(id(view), None)
        if view in self.backend.pools.get(name):
            self.backend.pools.get(name).remove(view)
        try:
            ray.kill(view.client.handle, no_restart=True)
        except Exception:
            pass
        await view.client.retire()
        await self._spawn_replacement(name, view.actor_id)

    async def _spawn_replacement(self, name: str, replaces: str) -> None:
        """Start a fresh actor of `name`; one that cannot start (e.g. cannot be placed) is owed and
        tried again on the next check, so the pool never stays short for good."""
        try:
            handle = self.factory.spawn(name)
            [new] = await self.factory.views([(name, handle)])
        except Exception as e:
            self._owed[name] = self._owed.get(name, 0) + 1
            log.error("%s actor to replace %s could not start (%s); retrying on the next check", name, replaces, e)
            return
        await add_actors(self.backend, name, [new])
        self.replaced += 1
        log.warning("%s actor %s replaced by %s", name, replaces, new.actor_id)
