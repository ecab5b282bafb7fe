"""Pool manager: keeps every pool whole.

Every `interval_s` it asks each actor for `info()`. An actor that does not
answer is marked unhealthy (the router stops sending it work); one that Ray
restarted (`max_restarts`) answers with a new incarnation and, for decode, a
new KV endpoint, and is taken back. One that Ray reports dead for good (no
restarts left), or that has not answered for `replace_after_s`, is replaced
by a fresh actor of the same pool.

`PoolManager.flip(actor_id, role)` switches a role-flippable actor (``routing.role_flips``,
`deploy.actor`) between prefill, decode and colocated while the cluster serves: the actor
leaves its pool, its in-flight requests end (or are handed off past the timeout), the actor
re-reads its role, and a fresh view joins the new role's pool (colocated actors serve in the
decode pool, prefilling every request themselves).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from deploy.actor_death import death_report
from deploy.launcher import ActorFactory
from router.dispatcher import Dispatcher
from router.pools import POOL_NAMES, DecodeView, PrefillView, role_of
from router.roles import POOL_OF_ROLE, ROLE_NAMES, role_named

log = logging.getLogger(f"pdserve.{__name__}")


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
    backend.remove_actor(name, view)
    return not view.busy


@dataclass(slots=True, frozen=True)
class Flip:
    """One finished role flip."""

    actor_id: str
    from_role: str
    to_role: str
    seconds: float              # leaving the old pool → in the new one
    drain_s: float              # ... of which the router waited for the actor's in-flight requests
    handed_off: int = 0         # requests the actor gave up past the timeout (migrated or retried elsewhere)
    ended_at: float = 0.0       # time.monotonic() when it was in the new pool


class PoolManager:
    def __init__(self, backend: Dispatcher, factory: ActorFactory, interval_s: float = 1.0,
                 timeout_s: float = 5.0, replace_after_s: float = 120.0, metrics=None):
        """metrics: None, or an object with ``role_flipped(from_role, to_role)`` (router.metrics.Metrics)."""
        self.backend, self.factory, self.metrics = backend, factory, metrics
        self.interval_s, self.timeout_s, self.replace_after_s = interval_s, timeout_s, replace_after_s
        self._silent_since: dict[int, float] = {}
        self._owed: dict[str, int] = {}        # pool -> replacements that could not start yet (retried)
        self.replaced = 0
        self.restarted = 0
        self.flips: list[Flip] = []

    async def flip(self, actor_id: str, role: str, timeout_s: float = 30.0) -> Flip:
        """Switch actor `actor_id` to `role` ("prefill" | "decode" | "colocated") without restarting it.

        Its requests of the old role finish first; past `timeout_s` the actor hands off the rest
        (decode requests migrate, queued prefills are retried elsewhere). No request is lost.

        Raises:
            KeyError: no prefill or decode actor has that id.
            ValueError: an unknown role, or the flip would leave the decode pool empty.
            RuntimeError: the actor is not role-flippable, or refused the flip (it is put back).
        """
        new_pool = POOL_OF_ROLE[role_named(role)]
        found = [(name, v) for name in ("prefill", "decode") for v in self.backend.views(name)
                 if v.actor_id == actor_id]
        if not found:
            raise KeyError(f"no prefill or decode actor {actor_id!r}")
        name, view = found[0]
        from_role = ROLE_NAMES[role_of(name, view)]
        if from_role == role:
            return Flip(actor_id, from_role, role, 0.0, 0.0)
        if new_pool != name and name == "decode" and len(self.backend.views(name)) == 1:
            raise ValueError(f"{actor_id} is the last decode actor; flip another actor to decode first")
        if not self.factory.flippable(name):
            raise RuntimeError(f"{actor_id} cannot change role (start the cluster with routing.role_flips: "
                               "manual or auto)")
        start = time.monotonic()
        self.backend.remove_actor(name, view)   # no new work of the old role from here on
        view.draining = True
        if name == "prefill":
            view.healthy = False
        await self.backend.pools_changed()
        end = start + timeout_s
        while view.busy and time.monotonic() < end:
            await asyncio.sleep(0.02)
        drain_s = time.monotonic() - start
        try:
            fresh, info = await self.factory.set_role(view, new_pool, role, max(end - time.monotonic(), 0.0))
        except Exception as e:
            view.draining, view.healthy = False, True
            await self.backend.add_actors(name, [view])
            raise RuntimeError(f"{actor_id} did not flip to {role}: {e}") from None
        self.backend.forget_actor(actor_id)
        await self.backend.add_actors(new_pool, [fresh])
        ended = time.monotonic()
        flip = Flip(actor_id, from_role, role, ended - start, drain_s, info.get("handed_off", 0), ended)
        if self.metrics is not None:
            self.metrics.role_flipped(from_role, role)
        self.flips.append(flip)
        log.info("actor %s flipped %s -> %s in %.2fs (%.2fs draining, %d requests handed off)", actor_id,
                 from_role, role, flip.seconds, drain_s, flip.handed_off)
        return flip

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
        checks = [(name, view) for name in POOL_NAMES for view in self.backend.views(name)]
        results = await asyncio.gather(*(self._info(v) for _, v in checks))
        now = time.monotonic()
        for (name, view), (info, dead) in zip(checks, results):
            if info is None:
                view.healthy = False
                since = self._silent_since.setdefault(id(view), now)
                if since == now:
                    why = await asyncio.to_thread(death_report, view.client.handle._actor_id.hex(), view.pid)
                    log.warning("%s actor %s is not answering: %s; taking it out of rotation", name,
                                view.actor_id, why)
                if dead or now - since >= self.replace_after_s:
                    await self._replace(name, view)
                continue
            self._silent_since.pop(id(view), None)
            view.pid = info.get("pid", view.pid)
            if info["incarnation"] != view.incarnation:
                view.incarnation = info["incarnation"]
                if isinstance(view, DecodeView):
                    view.endpoint = info["endpoint"]
                    await view.client.moved(info["stream_endpoint"])
                self.restarted += 1
                log.info("%s actor %s restarted by Ray; back in rotation", name, view.actor_id)
            if not view.draining:
                view.healthy = True
        await self.backend.pools_changed()

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
        self._silent_since.pop(id(view), None)
        self.backend.remove_actor(name, view)
        await self.factory.retire(view)
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
        await self.backend.add_actors(name, [new])
        self.replaced += 1
        log.warning("%s actor %s replaced by %s", name, replaces, new.actor_id)
