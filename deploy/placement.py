"""Placing pool actors on Ray: fit a local instance, bound the wait, say what is missing.

On a local Ray instance (no ``ray.address``) the pools may ask for more CPUs
than the node has — ``pdserve serve --decode-actors 2`` on a 2-core machine
asks for three actors of 1 CPU — and Ray would wait forever for the third.
`cpu_scale` gives every actor the same fraction of its ``num_cpus`` so that
they all fit (the launcher logs it once; CPUs are only Ray's bookkeeping here,
each actor keeps its torch threads). Where scaling cannot help (a joined
cluster, GPUs or custom resources the node lacks), `wait_placed` waits at most
``ray.placement_timeout_s`` for Ray to give every actor a worker and then
raises a `ConfigError` naming the pool, what one actor asks and what the
cluster has in total and free.

Ray's public API cannot tell an actor that waits for resources from one whose
constructor is still loading the model (both are PENDING_CREATION), so
`placed` reads the GCS actor table: an actor is placed once it has a worker
process. Only placement is timed; a slow constructor is not.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time

from deploy.config import ConfigError

log = logging.getLogger(f"pdserve.{__name__}")

RAY_RESOURCE_STEP = 1e-4    # Ray keeps fractional resources to four decimals
POLL_S = 0.25               # how often the actor table is read while actors wait
WARN_AFTER_S = 10.0         # one log line names the actors still waiting after this long
_PENDING_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION")
_HIDDEN = ("memory", "object_store_memory")   # bytes, not what a pool asks for


def cpu_scale(asked_cpus: float, node_cpus: float) -> float:
    """The fraction of its num_cpus each actor gets so that ``asked_cpus`` fit ``node_cpus`` (1.0 if they do)."""
    if asked_cpus <= node_cpus or node_cpus <= 0:
        return 1.0
    return node_cpus / asked_cpus


def scaled_cpus(num_cpus: float, scale: float) -> float:
    """``num_cpus * scale`` rounded down to Ray's step (never below one step); unchanged at scale 1."""
    if scale >= 1.0:
        return num_cpus
    steps = math.floor(num_cpus * scale / RAY_RESOURCE_STEP + 1e-9)
    return round(max(steps, 1) * RAY_RESOURCE_STEP, 4)


def placed(handle) -> bool:
    """Whether Ray gave the actor a worker process (or it is already past creation)."""
    from ray._private import state          # the public API has no placement signal (see the module docstring)
    try:
        info = state.actors(handle._actor_id.hex())
    except Exception:  # noqa: BLE001 — Ray internals moved: cannot tell, so never fail a deployment on it
        return True
    if not info:
        return False                       # not registered with the GCS yet
    if "State" not in info:
        return True
    return info["State"] not in _PENDING_STATES or bool(info.get("Pid"))


async def wait_placed(spawned: list[tuple[str, object]], timeout_s: float, asked: dict[str, dict[str, float]],
                      address: str | None) -> None:
    """Return once Ray has placed every actor of ``spawned`` ((pool, handle) pairs).

    Args:
        timeout_s: ``ray.placement_timeout_s``.
        asked: the resources one actor of each pool asks for ({"CPU": 1, "GPU": 0, custom...}).
        address: ``ray.address`` (None: a local instance).

    Raises:
        ConfigError: some actor was not placed within ``timeout_s`` (key ``pools.<pool>.resources``).
    """
    start = time.monotonic()
    waiting = list(spawned)
    warned = False
    while True:
        flags = await asyncio.to_thread(lambda: [placed(h) for _, h in waiting])
        waiting = [item for item, ok in zip(waiting, flags) if not ok]
        if not waiting:
            return
        elapsed = time.monotonic() - start
        if elapsed >= timeout_s:
            raise placement_error(waiting, timeout_s, asked, address)
        if not warned and elapsed >= WARN_AFTER_S:
            warned = True
            pools = sorted({pool for pool, _ in waiting})
            log.warning("waiting for Ray to place %d actor(s) of %s (one asks %s); cluster free: %s; "
                        "giving up after ray.placement_timeout_s = %g s", len(waiting), ", ".join(pools),
                        "; ".join(_show(asked[p], asked[p]) for p in pools), _cluster(asked, pools)[1], timeout_s)
        await asyncio.sleep(min(POLL_S, timeout_s - elapsed))


def placement_error(waiting: list[tuple[str, object]], timeout_s: float, asked: dict[str, dict[str, float]],
                    address: str | None) -> ConfigError:
    """The error for actors Ray did not place: the pool, what one actor asks, what the cluster has."""
    pools = list(dict.fromkeys(pool for pool, _ in waiting))
    total, free = _cluster(asked, pools)
    where = "this local Ray instance" if not address else f"the Ray cluster (ray.address={address})"
    parts = [f"pools.{pool}: Ray placed no node for {sum(p == pool for p, _ in waiting)} actor(s) within "
             f"ray.placement_timeout_s = {timeout_s:g} s; one actor asks {_show(asked[pool], asked[pool])}"
             for pool in pools]
    advice = ("; lower the pool's count or resources, or add nodes that have them"
              + (" (raise ray.placement_timeout_s if Ray's autoscaler must start them first)" if address else ""))
    return ConfigError(f"{'; '.join(parts)}; {where} has {total} in total and {free} free{advice}",
                       key=f"pools.{pools[0]}.resources")


def _cluster(asked: dict[str, dict[str, float]], pools: list[str]) -> tuple[str, str]:
    """(total, free) of the resources the pools ask for, CPU and GPU, and every custom resource."""
    import ray
    total, free = ray.cluster_resources(), ray.available_resources()
    keys = dict.fromkeys(["CPU", "GPU", *(k for p in pools for k in asked[p])])
    keys.update(dict.fromkeys(k for k in total if ":" not in k and k not in _HIDDEN))
    return _show(total, keys), _show(free, keys)


def _show(resources: dict[str, float], keys) -> str:
    return ", ".join(f"{key} {resources.get(key, 0):g}" for key in keys) or "nothing"
