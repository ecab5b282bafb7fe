"""Benchmark targets: a running router (``--address``) or an embedded cluster per serving variant.

Variants at equal total actors (each with the decode pool's resources):

    disaggregated       P prefill + D decode actors, KV shipped between them
    disaggregated-no-reuse  the same, every transfer shipping the whole prompt
                        (``routing.decode_prefix_reuse=false``: the peer of decode-side reuse)
    colocated           P + D colocated engines, whole prompts prefilled between decode steps
    colocated-chunked   the same with chunked prefill (``pools.prefill.chunk_tokens``, or
                        ``--colocated-chunk-tokens``: the chunk that protects decode steps in a
                        colocated engine, while a prefill actor keeps its own larger chunk)
    auto                the disaggregated actors with ``routing.mode: auto`` (per-request placement:
                        remote prefill or chunked prefill on the decode actor, router/placement/auto.py)
                        and ``routing.role_flips: auto`` (the autoscaler moves actors between the roles,
                        the prefill pool down to zero; ``--set routing.role_flips=off`` keeps the split)
    disaggregated-spec  disaggregated with ``speculative.method: ngram`` on the decode actors
    colocated-spec      colocated-chunked with ``speculative.method: ngram``
                        (each beside its plain variant: speculation's peer; docs/speculative.md)

The disaggregated variants set ``routing.mode: disaggregated`` and ``auto`` sets ``auto``, over the config
file and ``--set``: a variant runs as its name says.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

VARIANTS = {  # label -> (start_cluster mode, chunked prefill)
    "disaggregated": ("disaggregated", True),
    "disaggregated-no-reuse": ("disaggregated", True),
    "colocated": ("colocated", False),
    "colocated-chunked": ("colocated", True),
    "auto": ("disaggregated", True),
    "disaggregated-spec": ("disaggregated", True),
    "colocated-spec": ("colocated", True),
}


@dataclass(slots=True)
class Target:
    """Where a run sends its requests."""

    label: str
    address: str
    metrics_url: str | None = None
    token: str | None = None
    num_actors: int = 0
    http_url: str | None = None     # the OpenAI-compatible API (``http://host:port/v1``), when served
    apis: tuple[str, ...] = ()      # front doors to load here; empty: every one ``--api`` names
    pools: object | None = None     # embedded: the router's pools (actors per role over time)
    autoscaler: object | None = None    # embedded, when one runs: its decisions (the split it calls for)


def variants_of(compare: str | None, mode: str) -> list[str]:
    """``--compare colocated,disaggregated`` → the three variants; without it, ``mode`` alone."""
    if not compare:
        return [mode]
    out = []
    for name in (x.strip() for x in compare.split(",") if x.strip()):
        if name == "colocated":
            out += ["colocated", "colocated-chunked"]
        elif name in VARIANTS:
            out.append(name)
        else:
            raise ValueError(f"--compare: unknown variant {name!r} ({', '.join(VARIANTS)})")
    return list(dict.fromkeys(out))


def bench_config(config_path: str | None, model: str | None, dtype: str | None, overrides: list[str],
                 variant: str | None = None, colocated_chunk_tokens: int | None = None):
    """The deployment config for embedded runs: a free metrics port, CLI overrides applied.

    For ``colocated-chunked``, ``colocated_chunk_tokens`` (when given) replaces the chunk size."""
    from deploy.config import load_config
    values = variant_values(model, dtype, overrides, variant, colocated_chunk_tokens)
    values["server.metrics_port"] = 0   # start_cluster(port=0) binds a free one
    return load_config(config_path, values)


def variant_values(model: str | None, dtype: str | None, overrides: list[str], variant: str | None = None,
                   colocated_chunk_tokens: int | None = None) -> dict[str, object]:
    """The config overrides of a serving variant (`VARIANTS`), the model and dtype flags, then ``--set`` items."""
    from deploy.config import parse_override
    values: dict[str, object] = {"model.name": model, "model.dtype": dtype}
    if variant == "colocated-chunked" and colocated_chunk_tokens:
        overrides = [*overrides, f"pools.prefill.chunk_tokens={colocated_chunk_tokens}"]
    if variant in ("disaggregated", "disaggregated-no-reuse", "disaggregated-spec"):   # whatever the file says
        overrides = [*overrides, "routing.mode=disaggregated"]
    if variant == "disaggregated-no-reuse":
        overrides = [*overrides, "routing.decode_prefix_reuse=false"]
    elif variant == "auto":         # placement per request, and the split follows the load (prefill pool down to 0)
        overrides = ["routing.role_flips=auto", *overrides, "routing.mode=auto"]
    elif variant in ("disaggregated-spec", "colocated-spec"):
        overrides = ["speculative.method=ngram", *overrides]
    for item in overrides:
        key, value = parse_override(item)
        values[key] = value
    return values


def init_local_ray(cfg, num_cpus: float) -> None:
    """A private local Ray on 127.0.0.1 (never another job's cluster on this machine), unless
    ``ray.address`` says which cluster to join; start_cluster then finds Ray initialized."""
    from deploy.launcher import init_ray_for
    init_ray_for(cfg, num_cpus=num_cpus, log_to_driver=False)


@contextlib.asynccontextmanager
async def embedded(cfg, variant: str, autoscale=None):
    """Start the cluster of ``variant`` in this process; stop it (and its actors) on exit.
    autoscale: `deploy.autoscaler.AutoscaleSettings` (pools with count auto, routing.role_flips auto)."""
    from deploy.running import start_cluster
    mode, chunked = VARIANTS[variant]
    n = cfg.pools.prefill.bounds()[0] + cfg.pools.decode.bounds()[0]
    cpus = max(cfg.pools.prefill.resources.num_cpus, cfg.pools.decode.resources.num_cpus) * n
    init_local_ray(cfg, max(cpus, os.cpu_count() or 1))
    cluster = await start_cluster(cfg, port=0, mode=mode, chunked=chunked, autoscale=autoscale)
    try:
        if not await cluster.server.wait_ready(300):
            raise RuntimeError(f"{variant} cluster did not become ready")
        token = cfg.security.token.get_secret_value() if cfg.security.token else None
        yield Target(variant, cluster.address, cluster.metrics_url, token, n, cluster.http_url,
                     pools=cluster.backend.pools, autoscaler=cluster.autoscaler)
    finally:
        await cluster.stop()
