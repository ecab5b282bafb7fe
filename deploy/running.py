"""A running cluster in this process: Ray pools + the router's Dispatcher + its gRPC server."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from deploy.config import PDServeConfig
from deploy.launcher import (ActorFactory, cluster_token, init_ray_for, load_generation_defaults, load_tokenizer,
                             start_pools)
from deploy.performance import base_model, cached_profile, live_model, quick_profile
from deploy.pool_manager import PoolManager
from engine.model.presets import resolve_model
from router.dispatcher import Dispatcher
from router.metrics import Metrics, poll_stats
from router.openai_api import served_model_name
from router.openai_api.http_limits import HTTPLimits
from router.routing import RoutingSettings
from router.security import TLSConfig
from router.server import RouterServer, start_server

log = logging.getLogger(f"pdserve.{__name__}")


@dataclass
class RunningCluster:
    cfg: PDServeConfig
    backend: Dispatcher
    server: RouterServer
    factory: ActorFactory
    metrics: Metrics | None = None           # set when server.metrics_port is
    metrics_port: int | None = None          # the port /metrics listens on (server.metrics_port, or the free one)
    metrics_task: asyncio.Task | None = None
    manager: PoolManager | None = None
    manager_task: asyncio.Task | None = None
    autoscaler: object | None = None          # deploy.autoscaler.Autoscaler when a pool is `count: auto`
    autoscaler_task: asyncio.Task | None = None
    kv_poller_task: asyncio.Task | None = None   # Dispatcher.poll_kv_events (router.placement.kv_event_poller)

    @property
    def address(self) -> str:
        return f"{self.cfg.server.host}:{self.server.port}"

    @property
    def metrics_url(self) -> str | None:
        """The Prometheus scrape URL (``…/metrics``), or None when metrics are off."""
        return None if self.metrics_port is None else f"http://{self.cfg.server.host}:{self.metrics_port}/metrics"

    @property
    def http_url(self) -> str | None:
        """Base URL of the OpenAI-compatible API (``…/v1``), or None when HTTP is off."""
        port = self.server.http_port
        scheme = "https" if self.cfg.security.tls_cert else "http"
        return None if port is None else f"{scheme}://{self.cfg.server.host}:{port}/v1"

    async def stop(self, grace: float = 1.0) -> None:
        import ray
        await self.server.stop(grace)
        if self.autoscaler_task is not None:
            self.autoscaler_task.cancel()
        if self.manager_task is not None:
            self.manager_task.cancel()
        if self.kv_poller_task is not None:
            self.kv_poller_task.cancel()
        if self.metrics_task is not None:
            self.metrics_task.cancel()
        if self.metrics is not None:
            self.metrics.stop()
        await self.factory.streams.close()
        for view in self.backend.views():
            ray.kill(view.client.handle, no_restart=True)
        self.factory.retire_groups()          # tensor-parallel actors' other ranks and their placement groups
        log.info("cluster stopped")


def tls_of(cfg: PDServeConfig) -> TLSConfig | None:
    s = cfg.security
    return TLSConfig(s.tls_cert, s.tls_key, s.tls_client_ca) if s.tls_cert else None


def routing_settings(cfg: PDServeConfig) -> RoutingSettings:
    """The router's settings from the config's routing, kv_transfer and slo sections."""
    r = cfg.routing
    return RoutingSettings(r.local_prefill_tokens, r.long_request_tokens, r.max_queue,
                           transfer_deadline_s=cfg.kv_transfer.deadline_s, max_queue_wait_s=r.max_queue_wait_s,
                           max_prefill_backlog_tokens=r.max_prefill_backlog_tokens, mode=r.mode,
                           ttft_slo_s=cfg.slo.ttft_p99_ms / 1000, tpot_slo_s=cfg.slo.tpot_p99_ms / 1000,
                           decode_prefix_reuse=r.decode_prefix_reuse,
                           prefill_policy=r.prefill_policy, decode_policy=r.decode_policy,
                           kv_events_interval_s=r.kv_events_interval_s)


def max_in_flight(cfg: PDServeConfig, pools) -> int:
    """Requests the router holds at once: running on decode actors + waiting for KV room (routing.max_queue)."""
    batch = cfg.pools.decode.max_batch_size
    return cfg.routing.max_queue + batch * max(len(pools.decode), 1) + batch * len(pools.long_context)


async def start_cluster(cfg: PDServeConfig, port: int | None = None, mode: str = "disaggregated",
                        chunked: bool = True, autoscale=None) -> RunningCluster:
    """Bring up everything `cfg` describes; `port=0` picks a free port (tests).

    mode "colocated" serves the same model from colocated engines (the baseline).
    autoscale: `deploy.autoscaler.AutoscaleSettings` for pools with `count: auto` (default settings
    when None); the autoscaler runs whenever a pool is auto in disaggregated mode.
    """
    init_ray_for(cfg)
    factory = ActorFactory(cfg, cluster_token(cfg), mode, chunked)
    pools = await start_pools(factory)
    tokenizer, max_len = load_tokenizer(cfg)
    r = cfg.routing
    routing = routing_settings(cfg)
    metrics = Metrics() if cfg.server.metrics_port is not None else None
    autoscaled = mode == "disaggregated" and (any(p.is_auto for _, p in cfg.pools.items()) or r.role_flips == "auto")
    profile = getattr(autoscale, "profile", None) or cached_profile(cfg)
    if profile is None and autoscaled and pools.prefill and pools.decode:     # the autoscaler plans from measurements
        profile = await quick_profile(cfg, {name: pools.get(name)[0].client.handle for name in ("prefill", "decode")},
                                      factory.model_dir)
    live = live_model(cfg, base_model(cfg, factory.model_dir, profile))
    backend = Dispatcher(pools, tokenizer, max_len, cfg.kv_cache.block_size, routing,
                         codec=cfg.transfer_codec(), metrics=metrics,
                         generation_defaults=load_generation_defaults(cfg), live=live)
    public_token = cfg.security.token.get_secret_value() if cfg.security.token else None
    # port=0 (tests, embedded benchmarks) puts HTTP on a free port too, when it is on at all
    http_port = cfg.server.http_port if port is None or cfg.server.http_port is None else 0
    server = await start_server(backend, cfg.server.host, cfg.server.port if port is None else port,
                                token=public_token, tls=tls_of(cfg), max_queue=max_in_flight(cfg, pools),
                                metrics=metrics,
                                http_port=http_port, model_name=served_model_name(cfg.model.name),
                                model_dir=resolve_model(cfg.model.name),
                                http_limits=HTTPLimits(**cfg.server.http_limits.model_dump()),
                                tool_parser=cfg.model.tool_parser)
    metrics_task = metrics_port = None
    if metrics is not None:   # port=0 puts /metrics on a free port too; with a token, scrapes need it
        metrics_port = metrics.serve(cfg.server.host, 0 if port == 0 else cfg.server.metrics_port, public_token)
        metrics_task = asyncio.get_running_loop().create_task(poll_stats(backend, metrics))
    log.info("pdserve ready on %s:%d (%s) — %d prefill + %d decode actors, model %s, KV %s/%s%s",
             cfg.server.host, server.port, mode, len(pools.prefill), len(pools.decode), cfg.model.name,
             cfg.kv_transfer.transport, cfg.transfer_codec(),
             "" if metrics_port is None else f", /metrics on port {metrics_port}")
    manager = PoolManager(backend, factory, metrics=metrics)
    manager_task = asyncio.get_running_loop().create_task(manager.run())
    cluster = RunningCluster(cfg, backend, server, factory, metrics, metrics_port, metrics_task, manager, manager_task)
    cluster.kv_poller_task = asyncio.get_running_loop().create_task(backend.poll_kv_events())
    if autoscaled:
        from deploy.autoscaler import start_autoscaler
        cluster.autoscaler = await start_autoscaler(cfg, backend, factory, autoscale, manager)
        cluster.autoscaler_task = asyncio.get_running_loop().create_task(cluster.autoscaler.run())
    return cluster
