"""`pdserve bench chaos` / `python -m bench.chaos`: the chaos run of the failure contract.

    pdserve bench chaos                          2,000 requests, 2 prefill + 2 decode actors, tiny model
    pdserve bench chaos --num-requests 300 --json chaos.json

Builds the requests and their reference (the colocated engine, undisturbed), starts a local
cluster (float32, KV shipped uncompressed over gRPC so outputs are exact, fractional CPUs),
runs the requests with every drill injected, prints the report and writes it as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

from bench.chaos.drills import DRILLS
from bench.chaos.report import contract, render, summarize, write_json
from bench.chaos.run import RunSettings, run_chaos
from bench.chaos.workload import WorkloadSettings, add_references, make_requests


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="preset or model directory (default: tiny)")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=12, help="steady requests in flight")
    p.add_argument("--burst", type=int, default=48, help="requests a burst sends at once")
    p.add_argument("--rounds", type=int, help="the drill list this many times (default: 1 per 500 requests)")
    p.add_argument("--drills", default=",".join(DRILLS), help=f"comma list of {', '.join(DRILLS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-tokens", type=int, default=320)
    p.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens drawn")
    p.add_argument("--cancel-fraction", type=float, default=0.06)
    p.add_argument("--deadline-fraction", type=float, default=0.05)
    p.add_argument("--safety-deadline-s", type=float, default=60.0, help="deadline of every other request")
    p.add_argument("--stream-idle-s", type=float, default=3.0, help="router: an actor silent this long is stuck")
    p.add_argument("--transfer-deadline-s", type=float, default=3.0)
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per actor (admission room)")
    p.add_argument("--max-queue", type=int, default=16, help="routing.max_queue")
    p.add_argument("--max-batch-size", type=int, default=16, help="pools.decode.max_batch_size")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other config key")
    p.add_argument("--json", help="write the report (figures, faults, every request) here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--strict", action="store_true", help="exit 1 when a contract target is missed")
    return p


def chaos_config(model_dir: str, args: argparse.Namespace):
    from deploy.config import load_config, parse_override
    values: dict[str, object] = {
        "model.name": model_dir, "model.dtype": "float32", "model.attention": "eager",
        "pools.prefill.count": 2, "pools.decode.count": 2,
        "pools.prefill.resources.num_cpus": 0.5, "pools.decode.resources.num_cpus": 0.5,
        "pools.prefill.resources.torch_threads": 1, "pools.decode.resources.torch_threads": 1,
        "pools.prefill.max_restarts": -1, "pools.decode.max_restarts": -1,
        "pools.decode.max_batch_size": args.max_batch_size,
        "kv_cache.num_blocks": args.num_blocks, "kv_transfer.transport": "grpc", "kv_transfer.compression": "none",
        "kv_transfer.deadline_s": args.transfer_deadline_s, "routing.max_queue": args.max_queue,
        "server.host": "127.0.0.1",
    }
    for item in args.set:
        key, value = parse_override(item)
        values[key] = value
    return load_config(None, values)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()

    def say(line: str) -> None:
        print(line, flush=True)
    from engine.model.presets import resolve_model
    model_dir = resolve_model(args.model)
    cfg = chaos_config(model_dir, args)
    drills = tuple(d.strip() for d in args.drills.split(",") if d.strip())
    unknown = set(drills) - set(DRILLS)
    if unknown:
        print(f"--drills: unknown {', '.join(sorted(unknown))}; drills are {', '.join(DRILLS)}", file=sys.stderr)
        return 2
    workload = WorkloadSettings(num_requests=args.num_requests, seed=args.seed,
                                max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_tokens,
                                cancel_fraction=args.cancel_fraction, deadline_fraction=args.deadline_fraction,
                                safety_deadline_s=args.safety_deadline_s)
    settings = RunSettings(concurrency=args.concurrency, burst=args.burst,
                           rounds=args.rounds or max(1, args.num_requests // 500), drills=drills,
                           stream_idle_s=args.stream_idle_s, transfer_deadline_s=args.transfer_deadline_s,
                           progress_every_s=1e9 if args.no_progress else 3.0)
    requests = make_requests(workload)
    say(f"chaos: {len(requests)} requests, reference on the colocated engine ...")
    add_references(requests, model_dir, workload.stop_fraction, args.seed, progress=say)
    reference_s = time.monotonic() - t0
    say(f"chaos: reference done in {reference_s:.1f}s; starting 2 prefill + 2 decode actors")
    result = asyncio.run(_run(cfg, requests, settings, say))
    summary = summarize(requests, result)
    summary["figures"]["reference_s"] = round(reference_s, 1)
    summary["figures"]["total_s"] = round(time.monotonic() - t0, 1)
    say(render(summary))
    if args.json:
        write_json(args.json, {"args": vars(args), "run": dataclasses.asdict(settings),
                               "workload": dataclasses.asdict(workload)}, summary)
        say(f"wrote {args.json}")
    missed = [name for name, ok, _ in contract(summary["figures"]) if not ok]
    return 1 if args.strict and missed else 0


async def _run(cfg, requests, settings: RunSettings, say):
    import ray

    from deploy.launcher import init_ray_for
    from deploy.running import start_cluster
    started_ray = not ray.is_initialized()
    init_ray_for(cfg, num_cpus=max(2, os.cpu_count() or 2), log_to_driver=False)
    cluster = await start_cluster(cfg, port=0)
    try:
        if not await cluster.server.wait_ready(120):
            raise RuntimeError("the cluster never became ready")
        say(f"chaos: cluster ready on {cluster.address}; running")
        return await run_chaos(cluster, requests, settings, say)
    finally:
        await cluster.stop()
        if started_ray:
            ray.shutdown()
