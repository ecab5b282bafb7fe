"""One measured run of the serving benchmark against a target, and the same run over every variant.

``measure`` warms the target up, then sends the workload once per ``--cache`` state and
summarizes each pass; ``run_variants`` starts one embedded cluster per variant and front door
(or uses the given address) and merges what a function measured on each.
"""
from __future__ import annotations

import argparse
import asyncio

from bench.serving.clients import GrpcLoadClient, OpenAILoadClient
from bench.serving.cluster import Target, bench_config, embedded, variants_of
from bench.serving.load import run_load
from bench.serving.metrics import counter_delta, meets_slo, scrape, summarize
from bench.serving.slo_scale import calibrate
from bench.serving.workloads import make_workload


def autoscale_settings(args: argparse.Namespace):
    """The autoscaler's period for benchmark runs (--autoscale-interval; window 10 periods), or None."""
    interval = getattr(args, "autoscale_interval", None)
    if not interval:
        return None
    from deploy.autoscaler import AutoscaleSettings
    return AutoscaleSettings(interval_s=interval, window_s=10 * interval)


def workload_kwargs(args: argparse.Namespace) -> dict:
    return dict(scale=args.scale, prompt_len=args.prompt_len, output_len=args.output_len)


def apis_of(value: str) -> list[str]:
    """``--api grpc,openai`` → ["grpc", "openai"] (each front door measured against the same target)."""
    apis = [a.strip() for a in value.split(",") if a.strip()]
    bad = [a for a in apis if a not in ("grpc", "openai")]
    if bad or not apis:
        raise ValueError(f"--api: expected grpc, openai or grpc,openai; got {value!r}")
    return apis


async def open_client(target: Target, api: str):
    """The load client of one front door of ``target``."""
    if api == "grpc":
        return GrpcLoadClient(target.address, target.token)
    if not target.http_url:
        raise ValueError("--api openai needs the router's HTTP API (--http-url, or an embedded cluster)")
    return await OpenAILoadClient.for_server(target.http_url, target.token)


async def measure(target: Target, args: argparse.Namespace, specs: list, *, seed: int, label: str,
                  request_rate: float | None = None, concurrency: int | None = None) -> dict[str, dict]:
    """For each ``--api``: warm up, then run ``specs`` once per ``--cache`` state against ``target``
    (the OpenAI runs are labelled ``<label>-openai``)."""
    out: dict[str, dict] = {}
    for api in target.apis or apis_of(getattr(args, "api", "grpc")):
        client = await open_client(target, api)
        try:
            out.update(await _measure_with(client, target, args, specs, seed=seed,
                                           label=label if api == "grpc" else f"{label}-openai",
                                           request_rate=request_rate, concurrency=concurrency))
        finally:
            await client.close()
    return out


async def _measure_with(client, target: Target, args: argparse.Namespace, specs: list, *, seed: int, label: str,
                        request_rate: float | None, concurrency: int | None) -> dict[str, dict]:
    rate = args.request_rate if request_rate is None else request_rate
    conc = args.concurrency if concurrency is None else concurrency
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    class_slos = getattr(args, "class_slos", None)
    if getattr(args, "slo_scale", None) and not class_slos:     # once, on the first variant: the same SLOs for all
        if class_slos is None:
            args.class_slos = class_slos = {}
        class_slos.update(await calibrate(client, specs, args.slo_scale, args.timeout))
    states = [c.strip() for c in args.cache.split(",") if c.strip()]
    out: dict[str, dict] = {}
    if args.num_warmup:
        warm = make_workload(args.workload, args.num_warmup, seed + 10_000, **workload_kwargs(args))
        await run_load(client, warm, concurrency=args.num_warmup, seed=seed, tag="warmup", progress=False,
                       timeout=args.timeout)
    for i, state in enumerate(states):
        if state == "warm" and i == 0:   # warm alone: one unmeasured pass fills the cache
            await run_load(client, specs, concurrency=4, seed=seed, tag="fill", progress=False,
                           timeout=args.timeout)
        before = scrape(target.metrics_url, target.token)
        roles: list[dict] = []
        sampler = (asyncio.ensure_future(sample_roles(target.pools, roles, target.autoscaler))
                   if target.pools is not None else None)
        try:
            records, duration = await run_load(
                client, specs, request_rate=rate, burstiness=args.burstiness, concurrency=conc, seed=seed,
                label=f"{label} ({state})", tag=f"{label}-{state}", progress=not args.no_progress,
                timeout=args.timeout)
        finally:
            if sampler is not None:
                sampler.cancel()
        summary = summarize(records, duration, *slo, class_slos=class_slos or None)
        summary.update(counter_delta(before, scrape(target.metrics_url, target.token)))
        summary.update(cache=state, request_rate=rate, concurrency=conc, variant=target.label, api=client.api)
        summary["records"] = [{**r.to_dict(), "meets_slo": meets_slo(r, *slo, class_slos or None)} for r in records]
        if roles:
            summary["roles_over_time"] = roles
        out[label if state == states[0] else f"{label}-{state}"] = summary
    return out


def router_slo(args: argparse.Namespace) -> list[str]:
    """The cluster's `slo` (what routing.mode auto and the autoscaler aim at) from the benchmark's SLOs:
    the fixed pair, or with per-class SLOs the loosest TTFT (the long prompts auto places) and the
    tightest TPOT (every running request's)."""
    classes = getattr(args, "class_slos", None)
    if classes:
        ttft = max(c["ttft_s"] for c in classes.values()) * 1e3
        tpot = min(c["tpot_s"] for c in classes.values()) * 1e3
    else:
        ttft, tpot = args.slo_ttft_ms, args.slo_tpot_ms
    return [f"slo.ttft_p99_ms={ttft:.6g}", f"slo.tpot_p99_ms={tpot:.6g}"]


async def sample_roles(pools, out: list[dict], autoscaler=None, interval_s: float = 0.5) -> None:
    """Append {t, prefill, decode, colocated} (actors per role, by the router's pools) every interval
    until cancelled; t in seconds from the start. With an autoscaler that balances roles, also its last
    tick's view: `planned_prefill` (of all actors, the planner's needs alone), `ideal_prefill` (what the
    balancer aimed at: in mode auto, the planner's prefill need split by `remote_share`) and `remote_share`."""
    import time
    start = time.monotonic()
    while True:
        decode = [v for v in pools.decode]
        sample = {"t": round(time.monotonic() - start, 2), "prefill": len(pools.prefill),
                  "decode": sum(1 for v in decode if v.endpoint), "colocated": sum(1 for v in decode
                                                                                    if not v.endpoint)}
        last = autoscaler.history[-1] if autoscaler is not None and autoscaler.history else None
        if last is not None and last.split is not None:
            p, d = last.plan.needed_prefill, last.plan.needed_decode
            actors = sample["prefill"] + sample["decode"] + sample["colocated"]
            sample.update(planned_prefill=round(actors * p / (p + d), 3) if p + d > 0 else None,
                          ideal_prefill=round(last.split.ideal_prefill, 3),
                          remote_share=last.observation.remote_share)
        out.append(sample)
        await asyncio.sleep(interval_s)


async def run_variants(args: argparse.Namespace, fn) -> dict[str, dict]:
    """``await fn(target)`` against each variant (embedded) or the given address; merged results.

    Embedded, each front door of ``--api`` gets a fresh cluster of its own, so every one starts
    from the same cold prefix cache (against one address they share the server and its cache:
    the second front door would find the first one's prompts cached)."""
    if args.address:
        return await fn(Target("server", args.address, args.metrics_url, args.token,
                               http_url=getattr(args, "http_url", None)))
    results: dict[str, dict] = {}
    for variant in variants_of(args.compare, args.mode):
        for api in apis_of(getattr(args, "api", "grpc")):
            cfg = bench_config(args.config, args.model, args.dtype, [*args.set, *router_slo(args)], variant,
                               args.colocated_chunk_tokens)
            async with embedded(cfg, variant, autoscale_settings(args)) as target:
                target.apis = (api,)
                results.update(await fn(target))
    return results
