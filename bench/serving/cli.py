"""Serving benchmark: latency, throughput and goodput of pdserve under a workload.

    python -m bench.serving --embedded --model tiny --workload mixed --request-rate 2 --num-requests 50
    python -m bench.serving --address 127.0.0.1:50051 --metrics-url http://127.0.0.1:9090/metrics
    python -m bench.serving --embedded --compare colocated,disaggregated --workload mixed --json out.json
    python -m bench.serving --embedded --sweep concurrency --compare colocated,disaggregated --plot-dir img/
    python -m bench.serving --embedded --compare colocated,disaggregated,auto --slo-scale 4 --sweep rate
    python -m bench.serving --embedded --workload phases --set routing.role_flips=auto --request-rate 2
    python -m bench.serving --embedded --workload structured --batch-sizes 1,32 --num-requests 32

One run = warm-up requests (excluded, prompts unrelated to the measured ones), then the
workload on its arrival schedule; with ``--cache cold,warm`` the identical workload runs a
second time so every prompt prefix is cached. Figures: see `bench.serving.metrics`.
``--compare`` runs the identical workload (same seed) against each serving variant at
equal total actors and prints them side by side with ratios (disaggregated / other).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile

from bench.serving.arg_types import (non_negative_int, output_file, positive_float, positive_int,
                                      request_rate)
from bench.serving.cluster import bench_config
from bench.serving.runs import measure, run_variants, workload_kwargs
from bench.serving.slo_scale import slo_line, slo_record
from bench.serving.strict_json import write_json
from bench.serving.sweep import run_sweep
from bench.serving.tables import lengths_line, table
from bench.serving.timeline_view import median_request, render
from bench.serving import multi_turn, structured_cost
from bench.serving.workloads import MULTI_TURN, STRUCTURED, describe, make_conversations, make_workload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.split("\n")[0])
    t = p.add_argument_group("target")
    t.add_argument("--address", help="host:port of a running router")
    t.add_argument("--token", help="bearer token of that router")
    t.add_argument("--metrics-url", help="its Prometheus endpoint, for KV bytes (e.g. http://127.0.0.1:9090/metrics)")
    t.add_argument("--http-url", help="the router's OpenAI API for --api openai, e.g. http://127.0.0.1:8000/v1")
    t.add_argument("--api", default="grpc", help="front door(s) to load: grpc, openai, or grpc,openai (both, "
                   "same target, side by side: the HTTP overhead)")
    t.add_argument("--embedded", action="store_true", help="start the cluster in this process")
    t.add_argument("--mode", choices=["disaggregated", "colocated", "colocated-chunked", "auto"],
                   default="disaggregated")
    t.add_argument("--compare", help="variants to run side by side, e.g. colocated,disaggregated (embedded)")
    t.add_argument("--config", help="pools.yaml for the embedded cluster")
    t.add_argument("--model", help="preset (tiny, small) or model directory for the embedded cluster")
    t.add_argument("--dtype", choices=["auto", "float32", "bfloat16"])
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    t.add_argument("--autoscale-interval", type=positive_float, default=2.0, metavar="S",
                   help="autoscaler period of embedded clusters (pools with count auto, routing.role_flips=auto); "
                   "its window is 10 periods")
    t.add_argument("--colocated-chunk-tokens", type=positive_int, metavar="N",
                   help="chunk size of the colocated-chunked variant (default: pools.prefill.chunk_tokens)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="mixed", help="chat | rag | mixed | shared-prefix | multi-turn | phases "
                   "(chat → rag → chat, with actors per role over time) | structured (TPOT with vs without a "
                   "JSON-schema mask, per --batch-sizes) | FILE.jsonl")
    w.add_argument("--num-requests", type=positive_int, default=64, help="requests (multi-turn: conversations)")
    w.add_argument("--num-turns", type=positive_int, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--interleave", action="store_true", help="multi-turn: turn k of every conversation before "
                   "turn k + 1 of any (more conversations than the caches hold: their prefixes get evicted)")
    w.add_argument("--tiers", help="multi-turn, embedded: KV tier variants side by side, each on a fresh cluster: "
                   "none, host, disk (e.g. none,host,disk)")
    w.add_argument("--tier-gib", type=positive_float, default=1.0, help="--tiers: each tier's capacity per actor, GiB")
    w.add_argument("--tier-dir", help="--tiers disk: the directory (default: a new temporary one)")
    w.add_argument("--batch-sizes", default="1,32", help="structured: the concurrencies to compare at (each runs "
                   "max(--num-requests, size) requests, free and constrained)")
    w.add_argument("--num-warmup", type=non_negative_int, default=2)
    w.add_argument("--scale", type=positive_float, default=1.0, help="multiply every prompt and output length")
    w.add_argument("--prompt-len", type=positive_int, help="fix every prompt's length")
    w.add_argument("--output-len", type=positive_int, help="fix every output's length")
    w.add_argument("--request-rate", type=request_rate, default=math.inf,
                   help="mean arrivals per second (inf: all at once)")
    w.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    w.add_argument("--concurrency", type=positive_int, help="most requests in flight")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--cache", default="cold", help="cold, warm or cold,warm (prefix cache state)")
    w.add_argument("--timeout", type=positive_float, default=600.0, help="per-request deadline (s)")
    s = p.add_argument_group("SLOs and output")
    s.add_argument("--slo-ttft-ms", type=positive_float, default=1000.0)
    s.add_argument("--slo-tpot-ms", type=positive_float, default=100.0)
    s.add_argument("--slo-scale", type=positive_float, metavar="S", help="per request class, SLOs = S x its TTFT and "
                   "TPOT alone on this machine, measured first (replaces --slo-ttft-ms/--slo-tpot-ms)")
    s.add_argument("--slo-from", metavar="JSON", help="take --slo-scale's per-class SLOs from an earlier run's "
                   "JSON (so variants run in separate invocations are held to the same SLOs)")
    s.add_argument("--sweep", choices=["output-len", "prompt-len", "concurrency", "rate"])
    s.add_argument("--sweep-values", help="comma-separated values of the swept variable (rate without values: "
                   "fractions of the capacity measured on the first variant)")
    s.add_argument("--plot-dir", default=".", help="where sweep PNGs go")
    s.add_argument("--hf-baseline", action="store_true", help="also time HF transformers generate (static batching)")
    s.add_argument("--hf-batch-size", type=positive_int, default=8)
    s.add_argument("--json", type=output_file, help="write every figure and per-request record here")
    s.add_argument("--timeline", action="store_true", help="draw one request's path to its first token, "
                   "stage by stage (the median-TTFT request of each run)")
    s.add_argument("--no-progress", action="store_true")
    return p


async def bench_multi_turn(args: argparse.Namespace) -> dict:
    """KV wire bytes and TTFT per turn of multi-turn conversations (bench.serving.multi_turn)."""
    conversations = make_conversations(args.num_requests, args.num_turns, args.seed, args.scale, args.output_len)
    block = multi_turn.kv_block_bytes(bench_config(args.config, args.model, args.dtype, args.set))
    print(f"workload multi-turn: {len(conversations)} conversations of {args.num_turns} turns"
          f"{', interleaved' if args.interleave else ''}", file=sys.stderr)
    if not args.tiers:
        runs = await run_variants(args, lambda t: multi_turn.measure(t, args, conversations, block))
    else:
        if args.address:
            raise ValueError("--tiers starts a cluster per tier variant: use it with --embedded")
        runs = {}
        with tempfile.TemporaryDirectory(prefix="pdserve-kv-tier-") as scratch:
            for tier in args.tiers.split(","):
                overrides = multi_turn.tier_overrides(tier, args.tier_gib, args.tier_dir or scratch)
                variant = argparse.Namespace(**{**vars(args), "set": [*args.set, *overrides]})
                runs.update(await run_variants(
                    variant, lambda t, tier=tier: multi_turn.measure(t, args, conversations, block, tier)))
    return {"workload": MULTI_TURN, "num_conversations": len(conversations), "num_turns": args.num_turns,
            "seed": args.seed, "scale": args.scale, "interleave": args.interleave, "tiers": args.tiers,
            "runs": runs}


async def bench_runs(args: argparse.Namespace) -> dict:
    specs = make_workload(args.workload, args.num_requests, args.seed, **workload_kwargs(args))
    lengths = describe(specs)
    print(f"workload {args.workload}: {len(specs)} requests; {lengths_line(lengths)}", file=sys.stderr)
    runs = await run_variants(args, lambda t: measure(t, args, specs, seed=args.seed, label=t.label))
    if args.workload == "phases":
        for name, run in runs.items():
            if run.get("roles_over_time"):
                report_phases(name, run, args.plot_dir)
    if args.hf_baseline:
        from bench.serving.hf import hf_static_batching
        cfg = bench_config(args.config, args.model, args.dtype, args.set)
        runs["hf-static"] = hf_static_batching(cfg, specs, args.hf_batch_size)
    return {"workload": args.workload, "lengths": lengths, "num_requests": len(specs),
            "slo": slo_record(args), "seed": args.seed,
            "request_rate": args.request_rate, "burstiness": args.burstiness, "concurrency": args.concurrency,
            "runs": runs}


def report_phases(name: str, run: dict, plot_dir: str) -> None:
    """Actors per role and SLO attainment over the phases run: printed, in the JSON, and a PNG."""
    import os

    from bench.serving.plots import plot_phases
    from bench.serving.slo_scale import phase_report
    report = phase_report(run["records"], run["roles_over_time"])
    run["phases"] = report
    os.makedirs(plot_dir, exist_ok=True)
    path = os.path.join(plot_dir, f"phases_{name}.png")
    report["plot"] = plot_phases(run["roles_over_time"], report["attainment"], report["shifts_s"], path,
                                 f"{name}: chat → rag → chat, actors per role and SLO attainment")
    print(f"{name}: shifts at " + ", ".join(f"{t:.0f}s" for t in report["shifts_s"]), file=sys.stderr)
    for i, phase in enumerate(report["phases"]):
        print(f"  phase {i} from {phase['start_s']:.0f}s: {phase['prefill_actors']} prefill actors at its end, "
              f"{phase['num_changes']} changes, settled after {phase['settled_after_s']:.0f}s, "
              f"{phase['reversals']} reversals", file=sys.stderr)
    print(f"wrote {path}", file=sys.stderr)


def print_runs(result: dict, timeline: bool = False) -> None:
    runs = {k: v for k, v in result["runs"].items()}
    ref = "disaggregated" if "disaggregated" in runs and len(runs) > 1 else None
    print(f"\nworkload {result['workload']}, {result['num_requests']} requests, rate {result['request_rate']} req/s, "
          f"{slo_line(result['slo'])}")
    print(lengths_line(result["lengths"]))
    print(table(runs, ratio_of=ref))
    for name, run in runs.items():
        for err in run.get("errors", []):
            print(f"  {name} error: {err}")
    if timeline:
        for name, run in runs.items():
            record = median_request(run.get("records", []))
            print(f"\n{name}, median-TTFT request:\n{render(record) if record else '  no timeline (OpenAI API?)'}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.class_slos = {}         # filled on the first variant when --slo-scale is given (shared by all)
    if args.slo_from:
        try:
            with open(args.slo_from) as f:
                slo = json.load(f)["slo"]
            args.slo_scale = slo["scale"]
            args.class_slos.update({k: {f"{m.removesuffix('_ms')}_s": v / 1e3 for m, v in c.items()}
                                    for k, c in slo["by_class"].items()})
        except (OSError, ValueError, KeyError) as e:
            print(f"--slo-from {args.slo_from}: no per-class SLOs there ({e})", file=sys.stderr)
            return 2
    if bool(args.address) == bool(args.embedded):
        print("give exactly one of --address or --embedded", file=sys.stderr)
        return 2
    if args.compare and args.address:
        print("--compare starts each variant itself: use it with --embedded", file=sys.stderr)
        return 2
    try:
        if args.workload == STRUCTURED:
            result = asyncio.run(structured_cost.bench_structured(args))
            print(f"\nworkload structured, {lengths_line(result['lengths'])}")
            print(structured_cost.table(result))
        elif args.workload == MULTI_TURN:
            result = asyncio.run(bench_multi_turn(args))
            print(multi_turn.turn_table(result["runs"]))
            for name, run in result["runs"].items():
                for err in run["errors"]:
                    print(f"  {name} error: {err}")
        elif args.sweep:
            result = asyncio.run(run_sweep(args))
        else:
            result = asyncio.run(bench_runs(args))
            print_runs(result, timeline=args.timeline)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}", file=sys.stderr)
    failed = sum(r.get("failed", 0) for r in result.get("runs", {}).values())
    return 1 if failed else 0

