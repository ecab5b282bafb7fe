"""Start the cluster a config describes: Ray, the prefill/decode actor pools, the router.

This is the one place that applies Ray to the actor class that wraps the plain
workers (`ray.remote(ServingActor)`, deploy/actor.py) with resources from
pools.yaml — scaled to fit a local Ray instance, and waited for no longer
than ``ray.placement_timeout_s`` (deploy/placement.py) — and the startup
check that every pool agrees on the KV layout.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets

import torch

from decode_worker.stream_service import DecodeStreamClient
from deploy.actor_clients import RayDecodeClient, RayPrefillClient
from deploy.config import ConfigError, PDServeConfig
from deploy.placement import cpu_scale, scaled_cpus, wait_placed
from engine.args import EngineArgs
from engine.engine import pick_dtype
from engine.kv_cache.kv_format import KVFormat
from engine.kv_cache.tiers import TierSpec
from engine.model.config import ModelConfig
from engine.model.presets import resolve_model
from engine.parallel.group import free_port
from engine.parallel.shard import check_degree
from engine.sampling.generation_config import GenerationConfig
from engine.tokenizer import Tokenizer
from kv_transfer import HandshakeError, TransferSettings, check_compatible
from kv_transfer.settings import NixlOptions
from proto.internal_auth import internal_secret
from router.pools import DecodeView, Pools, PrefillView

log = logging.getLogger(f"pdserve.{__name__}")
LOCAL_START_ATTEMPTS = 2      # a local Ray instance that times out starting is started afresh once

# Budget base per actor on CPU when only memory_fraction is set. GPU actors size their cache from the
# device instead (EngineArgs.kv_memory_fraction); for them this only gives the planner an estimate.
CPU_KV_DEFAULT_BYTES = 1 << 30


def init_ray(address: str | None = None, namespace: str = "pdserve", num_cpus: float | None = None,
             log_to_driver: bool = True, secret_values: tuple[str, ...] = ()) -> None:
    """Join `address`, or start a local Ray instance with every listener on 127.0.0.1.

    A local instance's processes (GCS, raylet, and through the raylet every worker and actor)
    inherit this process's environment: a variable whose value holds one of ``secret_values``
    (the public token, read through ``security.token_env``) is held out of it while they start,
    so no actor's ``/proc/<pid>/environ`` carries it. Actors get only the internal secret, as an
    argument.
    """
    import ray
    if ray.is_initialized():
        return
    # A call to an actor killed mid-call fails once Ray has its death info, after at most this long
    # (default 1 s): the router notices a dead prefill actor within it and retries elsewhere.
    os.environ.setdefault("RAY_timeout_ms_task_wait_for_death_info", "200")
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=log_to_driver)
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # keep Ray on loopback
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            with environment_without(secret_values):
                # address="local": always a fresh instance, never a cluster some other process left behind.
                ray.init(address="local", num_cpus=num_cpus, namespace=namespace, include_dashboard=False,
                         _node_ip_address="127.0.0.1", log_to_driver=log_to_driver, configure_logging=False)
            return
        except Exception as e:
            # On a busy host the raylet can miss Ray's start-up timeout; a second fresh instance usually starts.
            if "timed out during startup" not in str(e) or attempt == LOCAL_START_ATTEMPTS:
                raise
            log.warning("local Ray did not start (%s); starting a fresh instance (attempt %d of %d)",
                        str(e).split(".")[0], attempt + 1, LOCAL_START_ATTEMPTS)
            ray.shutdown()


def init_ray_for(cfg: PDServeConfig, **kwargs) -> None:
    """`init_ray` for the cluster ``cfg`` describes: its Ray address and namespace; the configured
    token is kept out of a local instance's environment."""
    token = cfg.security.token
    init_ray(cfg.ray.address, cfg.ray.namespace, secret_values=(token.get_secret_value(),) if token else (),
             **kwargs)


@contextlib.contextmanager
def environment_without(secret_values: tuple[str, ...]):
    """Remove from ``os.environ`` every variable whose value contains one of ``secret_values``; put them back after."""
    held = {name: value for name, value in os.environ.items()
            if any(secret and secret in value for secret in secret_values)}
    for name in held:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(held)


def engine_args(cfg: PDServeConfig, pool: str, model_dir: str, mcfg: ModelConfig | None = None) -> EngineArgs:
    """The engine settings of an actor of `pool` (`mcfg`: the model's shape, read from `model_dir` when None)."""
    p = getattr(cfg.pools, pool)
    kv = cfg.pool_kv_cache(pool)
    mcfg = mcfg or ModelConfig.from_dir(model_dir)
    dtype = cfg.model.dtype
    device = torch.device("cuda" if p.resources.num_gpus else "cpu")
    kv_format = KVFormat(kv.dtype, mcfg.num_hidden_layers, mcfg.num_key_value_heads, kv.block_size, mcfg.head_dim,
                         pick_dtype(dtype, device))
    num_blocks = kv.resolve_num_blocks(kv_format.bytes_per_block, CPU_KV_DEFAULT_BYTES)
    quantization, group_size, key = cfg.pool_quantization(pool)
    if quantization == "int8" and mcfg.quantization is not None:
        raise ConfigError(f"{key}: int8 cannot apply to {model_dir}, a 4-bit {mcfg.quantization.method} "
                          "checkpoint (served int4 as stored): set none or int4", key)
    tp_key = f"pools.{pool}.tensor_parallel"
    try:
        check_degree(mcfg, p.tensor_parallel, tp_key, quantization)
    except ValueError as e:
        raise ConfigError(str(e), tp_key) from None
    args = EngineArgs(model=model_dir, dtype=dtype, block_size=kv.block_size, num_blocks=max(num_blocks, 1),
                      max_model_len=cfg.model.max_model_len, torch_threads=p.resources.threads(),
                      attention=cfg.model.attention,
                      weight_layout=cfg.model.weight_layout if device.type == "cpu" else "auto",
                      quantization=quantization, quantization_group_size=group_size,
                      quantize_lm_head=cfg.model.quantize_lm_head, kv_cache_dtype=kv.dtype,
                      kv_tiers=tuple(TierSpec(t.kind, t.capacity_bytes, t.path, t.fsync, t.reopen) for t in kv.tiers),
                      kv_offload_queue_blocks=kv.offload_queue_blocks,
                      tensor_parallel=p.tensor_parallel)
    if device.type == "cuda":
        args.kv_memory_fraction = kv.device_fraction()
    if pool == "prefill":
        args.max_num_batched_tokens = p.max_batch_tokens
        args.chunk_size = p.chunk_tokens
        if device.type == "cpu" or args.attention == "compiled":
            args.attention = "eager"    # a prefill actor never decodes: skip compiling the decode kernel
        # (on CUDA the flex kernel also serves prefill: batched, paged, no gather)
    else:
        args.max_num_seqs = p.max_batch_size
        args.chunk_size = cfg.pools.prefill.chunk_tokens
        args.speculative = cfg.speculative.engine_config()
    return args


def actor_tiers(tiers: tuple[TierSpec, ...], actor_id: str) -> tuple[TierSpec, ...]:
    """The tiers of one actor: a disk tier's blocks in a subdirectory named after the actor (a restarted
    actor of the same name reopens it; two actors never share one)."""
    return tuple(dataclasses.replace(t, path=os.path.join(t.path, actor_id)) if t.kind == "disk" else t
                 for t in tiers)


def colocated_engine_args(cfg: PDServeConfig, model_dir: str, chunked: bool = True,
                          mcfg: ModelConfig | None = None) -> EngineArgs:
    """A colocated actor's engine: the decode pool's cache and batch, the prefill pool's token budget (and
    its chunk when `chunked`)."""
    args = engine_args(cfg, "decode", model_dir, mcfg)
    args.chunk_size = args.chunk_size if chunked else None
    args.max_num_batched_tokens = cfg.pools.prefill.max_batch_tokens
    return args


def role_engine_args(cfg: PDServeConfig, model_dir: str, mcfg: ModelConfig | None = None
                     ) -> tuple[EngineArgs, dict]:
    """A role-flippable actor's engine (the decode pool's KV cache and attention; room for the largest
    batch of any role) and the scheduler limits of each role (`deploy.actor.RoleLimits`)."""
    from deploy.actor import RoleLimits
    args = engine_args(cfg, "decode", model_dir, mcfg)
    prefill, decode = cfg.pools.prefill, cfg.pools.decode
    defaults = EngineArgs()
    limits = {"prefill": RoleLimits(defaults.max_num_seqs, prefill.max_batch_tokens, prefill.chunk_tokens),
              "decode": RoleLimits(decode.max_batch_size, defaults.max_num_batched_tokens, prefill.chunk_tokens),
              "colocated": RoleLimits(decode.max_batch_size, prefill.max_batch_tokens, prefill.chunk_tokens)}
    args.max_num_seqs = max(limit.max_num_seqs for limit in limits.values())
    args.max_num_batched_tokens = max(limit.max_num_batched_tokens for limit in limits.values())
    return args, limits


def transfer_settings(cfg: PDServeConfig, cluster_token: str, bind_host: str) -> TransferSettings:
    """The actors' transfer settings: they carry the secret derived from the token, never the token."""
    t = cfg.kv_transfer
    nixl = NixlOptions(**t.nixl.options())
    return TransferSettings(t.transport, cfg.transfer_codec(), internal_secret(cluster_token), t.chunk_bytes,
                            t.deadline_s, bind_host, cfg.security.internal_tls(), layerwise=t.layerwise, nixl=nixl)


def _actor_options(cfg: PDServeConfig, pool: str, name: str, cpu_fraction: float = 1.0) -> dict:
    p = getattr(cfg.pools, pool)
    r = p.resources
    return dict(name=name, num_cpus=scaled_cpus(r.num_cpus, cpu_fraction), num_gpus=r.num_gpus,
                resources=dict(r.custom) or None, max_restarts=p.max_restarts, max_concurrency=1000, lifetime=None)


def asked_resources(cfg: PDServeConfig, pool: str) -> dict[str, float]:
    """What one actor of `pool` asks Ray for, as Ray names it (CPU, GPU when any, custom resources)."""
    r = getattr(cfg.pools, pool).resources
    return {"CPU": r.num_cpus, **({"GPU": r.num_gpus} if r.num_gpus else {}), **r.custom}


def tensor_parallel_degrees(cfg: PDServeConfig, mode: str) -> dict[str, int]:
    """Each pool's `tensor_parallel`, after refusing what tensor-parallel actors cannot do (change role, tier
    their KV) with a ConfigError naming the key."""
    degrees = {pool: p.tensor_parallel for pool, p in cfg.pools.items()}
    flips = mode != "colocated" and cfg.routing.role_flips != "off"
    for pool, degree in degrees.items():
        if degree > 1 and flips:
            raise ConfigError(f"pools.{pool}.tensor_parallel {degree}: tensor-parallel actors do not change "
                              "role; set routing.role_flips off", f"pools.{pool}.tensor_parallel")
    if cfg.kv_cache.tiers and max(degrees.values()) > 1:
        pool = next(pool for pool, degree in degrees.items() if degree > 1)
        raise ConfigError(f"kv_cache.tiers: tiers below the paged cache are not available with "
                          f"pools.{pool}.tensor_parallel {degrees[pool]}; remove the tiers or set the degree "
                          "to 1", "kv_cache.tiers")
    return degrees


class ActorFactory:
    """Creates pool actors with the resources pools.yaml gives them (also used by the autoscaler)."""

    def __init__(self, cfg: PDServeConfig, cluster_token: str, mode: str = "disaggregated", chunked: bool = True):
        self.cfg, self.mode, self.chunked = cfg, mode, chunked
        self.model_dir = resolve_model(cfg.model.name)    # materialize a preset once, before actors race for it
        multi_node = bool(cfg.ray.address)
        self.bind_host = "auto" if multi_node else "127.0.0.1"
        self.token = internal_secret(cluster_token)        # internal endpoints never see the public token
        self.tls = cfg.security.internal_tls()
        self.transfer = transfer_settings(cfg, cluster_token, self.bind_host)
        self.suffix = secrets.token_hex(3)
        self.first: dict | None = None
        self._next_index: dict[str, int] = {}
        self.cpu_fraction: float | None = None           # of each actor's num_cpus; set by fit_local
        self.streams = DecodeStreamClient(self.token, self.tls)  # the router's token streams to decode actors
        if multi_node and self.tls is None:
            log.warning("internal endpoints (KV, token streams) listen on node addresses in plaintext; "
                        "set security.internal_tls_cert/_key/_ca to encrypt them")
        self.rank_groups: dict[str, tuple[object, list]] = {}    # actor id -> (placement group, ranks 1..)
        degrees = tensor_parallel_degrees(cfg, mode)
        # KV travels resharded by head when a degree above 1 ships or receives it (kv_transfer/resharded.py)
        self.kv_degrees = ((degrees["prefill"], degrees["decode"])
                           if mode != "colocated" and max(degrees.values()) > 1 else None)
        if self.tls is not None and cfg.kv_transfer.transport not in ("grpc", "tcp"):
            log.warning("security.internal_tls_* encrypts the token streams, not kv_transfer.transport %s "
                        "(only the grpc and tcp transports run over TLS)", cfg.kv_transfer.transport)

    def most_actors(self, counts: dict[str, int] | None = None) -> dict[str, int]:
        """The most actors each pool can run (its count, or its max when auto), by the pool whose
        resources they take: in colocated mode every actor takes the decode pool's."""
        counts = counts or {}
        most = {pool: max(counts.get(pool) or 0, p.bounds()[1]) for pool, p in self.cfg.pools.items()}
        if self.mode == "colocated":
            most = {"decode": most["prefill"] + most["decode"]}
        # a tensor-parallel actor is one Ray actor per rank, each with the pool's resources
        return {pool: n * getattr(self.cfg.pools, pool).tensor_parallel for pool, n in most.items()}

    def fit_local(self, most: dict[str, int]) -> None:
        """On a local Ray instance, give every actor the same fraction of its num_cpus so that `most`
        actors per pool fit the node's CPUs (one log line when it scales); a joined cluster, GPUs and
        custom resources keep the configured numbers (placement then waits `ray.placement_timeout_s`)."""
        import ray
        self.cpu_fraction = 1.0
        if self.cfg.ray.address:
            return
        per_actor = {pool: getattr(self.cfg.pools, pool).resources.num_cpus for pool in most}
        asked = sum(n * per_actor[pool] for pool, n in most.items())
        node_cpus = ray.cluster_resources().get("CPU", 0.0)
        self.cpu_fraction = cpu_scale(asked, node_cpus)
        if self.cpu_fraction < 1.0:
            log.info("local Ray has %g CPUs and the pools ask for %g (%s): every actor gets %.4g of its num_cpus "
                     "(%s) so that all fit; torch threads are unchanged", node_cpus, asked,
                     ", ".join(f"{n} {pool} x {per_actor[pool]:g}" for pool, n in most.items()), self.cpu_fraction,
                     ", ".join(f"{pool} {scaled_cpus(c, self.cpu_fraction):g}" for pool, c in per_actor.items()))

    def flippable(self, pool: str) -> bool:
        """Whether the actors of `pool` start able to change role (``routing.role_flips`` manual or auto)."""
        return self.mode != "colocated" and self.cfg.routing.role_flips != "off" and pool in ("prefill", "decode")

    def spawn(self, pool: str):
        """Start one actor of `pool` ("prefill" | "decode" | "long_context"); returns its handle.
        In colocated mode every actor is a colocated engine with the decode pool's resources."""
        import ray

        from deploy.actor import log_named
        if self.cpu_fraction is None:
            self.fit_local(self.most_actors())
        index = self._next_index.get(pool, 0)
        self._next_index[pool] = index + 1
        limits, transfer = None, self.transfer
        if self.mode == "colocated":
            role, resources_of = "colocated", "decode"
            args = colocated_engine_args(self.cfg, self.model_dir, self.chunked)
            transfer = None                  # a colocated engine ships no KV
        else:
            role, resources_of = ("prefill" if pool == "prefill" else "decode"), pool
            if self.flippable(pool):
                args, limits = role_engine_args(self.cfg, self.model_dir)
            else:
                args = engine_args(self.cfg, pool, self.model_dir)
        actor_id = f"{role if role == 'colocated' else pool}-{index}"
        args.kv_tiers = actor_tiers(args.kv_tiers, actor_id)
        options = _actor_options(self.cfg, resources_of, self._name(actor_id), self.cpu_fraction)
        ranks = []
        if args.tensor_parallel > 1:       # a lost rank ends the group: the pool manager replaces it whole
            options["max_restarts"] = 0
            args = self._spawn_ranks(actor_id, args, options)
            options["scheduling_strategy"] = self._rank_strategy(actor_id, 0)
            ranks = [handle for handle, _ in self.rank_groups[actor_id][1]]
        return ray.remote(log_named(role)).options(**options).remote(
            args, actor_id, role, transfer=transfer, stream_token=self.token, bind_host=self.bind_host, tls=self.tls,
            limits=limits, ranks=ranks, kv_degrees=self.kv_degrees if transfer is not None else None)

    def _spawn_ranks(self, actor_id: str, args: EngineArgs, options: dict) -> EngineArgs:
        """A placement group of one bundle per rank (packed on one node) and ranks 1.. in it, each told to
        follow once its engine is built; returns rank 0's engine args."""
        import ray
        from ray.util.placement_group import placement_group

        from deploy.rank_actor import RankActor
        size = args.tensor_parallel
        bundle = {"CPU": options["num_cpus"], **({"GPU": options["num_gpus"]} if options["num_gpus"] else {}),
                  **(options["resources"] or {})}
        group = placement_group([bundle] * size, strategy="STRICT_PACK", name=f"{options['name']}-tp")
        args = dataclasses.replace(args, tensor_parallel_address=f"127.0.0.1:{free_port()}")
        self.rank_groups[actor_id] = (group, [])
        ranks = []
        for rank in range(1, size):
            handle = ray.remote(RankActor).options(
                name=f"{options['name']}-rank{rank}", num_cpus=options["num_cpus"], num_gpus=options["num_gpus"],
                resources=options["resources"], max_restarts=0, lifetime=None, max_concurrency=RANK_CONCURRENCY,
                scheduling_strategy=self._rank_strategy(actor_id, rank)
            ).remote(dataclasses.replace(args, tensor_parallel_rank=rank), actor_id)
            ranks.append((handle, handle.follow.remote()))
        self.rank_groups[actor_id] = (group, ranks)
        log.info("actor %s: %d tensor-parallel ranks in placement group %s", actor_id, size, options["name"])
        return args

    def _rank_strategy(self, actor_id: str, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        group, _ = self.rank_groups[actor_id]
        return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank)

    def _retire_ranks(self, actor_id: str) -> None:
        """Kill ranks 1.. of a tensor-parallel actor and free its placement group (nothing without one)."""
        import ray
        from ray.util.placement_group import remove_placement_group
        group, ranks = self.rank_groups.pop(actor_id, (None, []))
        for handle, _ in ranks:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:          # gone already
                pass
        if group is not None:
            remove_placement_group(group)

    def retire_groups(self) -> None:
        """Kill the follower ranks of every tensor-parallel actor and free their placement groups."""
        for actor_id in list(self.rank_groups):
            self._retire_ranks(actor_id)

    def _name(self, actor_id: str) -> str:
        return f"pdserve-{actor_id}-{self.suffix}"

    async def _started(self, spawned: list[tuple[str, object]]) -> list[dict]:
        """Every actor's info; placement is bounded by ray.placement_timeout_s, construction is not."""
        import ray
        infos = asyncio.ensure_future(asyncio.gather(*(h.info.remote() for _, h in spawned)))
        asked = {pool: asked_resources(self.cfg, pool) for pool, _ in spawned}    # colocated actors are "decode"
        placing = asyncio.ensure_future(wait_placed(spawned, self.cfg.ray.placement_timeout_s, asked,
                                                    self.cfg.ray.address))
        try:
            await asyncio.wait({infos, placing}, return_when=asyncio.FIRST_COMPLETED)
            if placing.done() and placing.exception() is not None:
                for _, handle in spawned:          # an actor placed later would serve nobody
                    ray.kill(handle, no_restart=True)
                raise placing.exception()
            return await infos
        finally:
            placing.cancel()
            if not infos.done():
                infos.cancel()
                infos.add_done_callback(lambda f: f.cancelled() or f.exception())   # retrieved: no warning

    async def views(self, spawned: list[tuple[str, object]]) -> list:
        """Wait for spawned actors; check their layouts agree with the first one ever seen.

        Raises:
            ConfigError: Ray did not place some actor within ``ray.placement_timeout_s`` (the batch is killed).
        """
        infos = await self._started(spawned)
        if self.first is None and infos:
            self.first = infos[0]
        check_layouts([self.first, *infos])
        return [self.view_of(pool, handle, info) for (pool, handle), info in zip(spawned, infos)]

    async def set_role(self, view, pool: str, role: str, timeout_s: float) -> tuple[object, dict]:
        """Switch the actor behind `view` to `role` (`deploy.actor.ServingActor.set_role`, which hands off
        what it still runs after `timeout_s`); its fresh view in `pool`, the new role's, and its info."""
        info = await view.client.handle.set_role.remote(role, timeout_s)
        return self.view_of(pool, view.client.handle, info), info

    async def retire(self, view) -> None:
        """Kill the actor behind `view` for good (no restart) and close the router's clients to it."""
        import ray
        try:
            ray.kill(view.client.handle, no_restart=True)
        except Exception:           # gone already
            pass
        self._retire_ranks(view.actor_id)
        await view.client.retire()

    def view_of(self, pool: str, handle, info: dict):
        """The router's view of an actor of `pool` (prefill, or a decode pool) from its `info()`."""
        actor_id = info["actor_id"]
        if pool == "prefill":
            view = PrefillView(actor_id, RayPrefillClient(actor_id, handle), info["kv_blocks_total"])
        else:
            client = RayDecodeClient(actor_id, handle, info["stream_endpoint"], self.streams)
            view = DecodeView(actor_id, client, info["endpoint"], info["kv_blocks_total"])
        view.incarnation, view.pid = info["incarnation"], info.get("pid", 0)
        return view


async def start_pools(factory: ActorFactory, counts: dict[str, int] | None = None) -> Pools:
    """Create every actor, wait until each is up, and refuse mismatched KV layouts.

    Colocated mode (the baseline at equal resources) runs as many colocated engines —
    decode actors without a KV receiver that prefill every request themselves — as the
    disaggregated layout has actors in all, each with the decode pool's resources.
    """
    cfg, counts = factory.cfg, counts or {}
    size = {pool: counts.get(pool) or getattr(cfg.pools, pool).bounds()[0] for pool, _ in cfg.pools.items()}
    factory.fit_local(factory.most_actors(size))
    if factory.mode == "colocated":
        spawned = [("decode", factory.spawn("decode")) for _ in range(size["prefill"] + size["decode"])]
    else:
        spawned = [(pool, factory.spawn(pool)) for pool in size for _ in range(size[pool])]
    log.info("starting %d actors (%s)", len(spawned), ", ".join(f"{n} {p}" for p, n in size.items()))
    views = await factory.views(spawned)
    pools = Pools()
    for (pool, _), view in zip(spawned, views):
        pools.get(pool).append(view)
    return pools


HEAD_KEYS = ("tensor_parallel", "kv_head_start", "num_kv_heads")
RANK_CONCURRENCY = 32     # a rank follows rank 0's steps on one thread and sends/receives KV copies on others


def check_layouts(infos: list[dict]) -> None:
    """Every actor must agree on model fingerprint, block size, KV layout, dtype and codec; where one end is
    tensor-parallel their KV-head ranges differ (KV travels resharded by head: kv_transfer/resharded.py)."""
    first = infos[0]
    for info in infos[1:]:
        mine, theirs = first["layout"], info["layout"]
        if max(mine.get("tensor_parallel", 1), theirs.get("tensor_parallel", 1)) > 1:
            mine, theirs = ({k: v for k, v in d.items() if k not in HEAD_KEYS} for d in (mine, theirs))
        try:
            check_compatible(mine, theirs)
        except HandshakeError as e:
            raise HandshakeError(f"{first['actor_id']} vs {info['actor_id']}: {e}") from None


def cluster_token(cfg: PDServeConfig) -> str:
    """The configured token, else a random one: internal endpoints always authenticate."""
    token = cfg.security.token
    return token.get_secret_value() if token is not None else secrets.token_urlsafe(24)


def load_tokenizer(cfg: PDServeConfig) -> tuple[Tokenizer, int]:
    """The router's tokenizer and context length, derived as the actors' engines derive them (`EngineArgs`)."""
    args = EngineArgs(model=resolve_model(cfg.model.name), max_model_len=cfg.model.max_model_len)
    return args.load_tokenizer(), args.context_length()


def load_generation_defaults(cfg: PDServeConfig) -> dict[str, object]:
    """The model's generation_config.json sampling defaults, for requests that leave those fields unset."""
    return dict(GenerationConfig.from_dir(resolve_model(cfg.model.name)).sampling_defaults)
