"""Sweeps of the serving benchmark, each written as a PNG:

    output-len    output length at a fixed prompt length (--prompt-len, default 128×scale)
    prompt-len    prompt length at a fixed output length (--output-len, default 32×scale)
    concurrency   closed-loop clients 1 → 32 on the workload
    rate          Poisson request rate: SLO attainment and goodput per variant (DistServe's curve); without
                  values, fractions of the capacity measured on the first variant; each variant's
                  ``max_rate_rps`` (highest rate at >= 90% attainment, interpolated) is in the result

With ``--compare`` every point runs against every variant, one cluster per variant.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from bench.serving.arg_types import float_list
from bench.serving.cluster import Target
from bench.serving.plots import plot_latency_sweep, plot_slo_attainment
from bench.serving.runs import measure, open_client, run_variants
from bench.serving.slo_scale import capacity_rps, max_rate_rps, rates_around, slo_line, slo_record
from bench.serving.workloads import describe, make_workload

DEFAULT_VALUES = {
    "output-len": "16,32,64,128",
    "prompt-len": "64,128,256,512",
    "concurrency": "1,2,4,8,16,32",
    "rate": "0.5,1,2,4",
}
FIGURES = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "itl_p99_s", "goodput_rps", "slo_attainment",
           "throughput_tokens_s", "completed", "failed")


def point_specs(args: argparse.Namespace, value: float, index: int) -> tuple[list, dict]:
    """The requests and load of one sweep point."""
    seed = args.seed + 100 * index            # fresh prompts per point: no prefix hits across points
    n, scale = args.num_requests, args.scale
    fixed_prompt = args.prompt_len or max(1, round(128 * scale))
    fixed_output = args.output_len or max(2, round(32 * scale))
    if args.sweep == "output-len":
        specs = make_workload(args.workload, n, seed, scale, prompt_len=fixed_prompt, output_len=int(value))
        return specs, dict(request_rate=math.inf, concurrency=args.concurrency or 4)
    if args.sweep == "prompt-len":
        specs = make_workload(args.workload, n, seed, scale, prompt_len=int(value), output_len=fixed_output)
        return specs, dict(request_rate=math.inf, concurrency=args.concurrency or 4)
    if args.sweep == "concurrency":
        specs = make_workload(args.workload, max(n, int(value)), seed, scale, args.prompt_len, args.output_len)
        return specs, dict(request_rate=math.inf, concurrency=int(value))
    specs = make_workload(args.workload, n, seed, scale, args.prompt_len, args.output_len)
    return specs, dict(request_rate=value, concurrency=args.concurrency)


async def run_sweep(args: argparse.Namespace) -> dict:
    raw = args.sweep_values or ("" if args.sweep == "rate" else DEFAULT_VALUES[args.sweep])
    values = float_list("--sweep-values", raw)
    capacity: dict[str, object] = {}
    args.cache = args.cache.split(",")[0]
    points: dict[str, list[dict]] = {}
    runs: dict[str, dict] = {}
    lengths = {}

    async def sweep_target(target: Target) -> dict:
        local = argparse.Namespace(**vars(args))
        if not values:                        # rates around the capacity of the first variant
            specs, _ = point_specs(args, 0.0, 99)
            client = await open_client(target, "grpc")
            try:
                rps = await capacity_rps(client, specs, args.timeout)
            finally:
                await client.close()
            capacity.update(rps=rps, variant=target.label)
            values.extend(rates_around(rps))
            print(f"capacity of {target.label}: {rps:.2f} req/s; rates {values}", file=sys.stderr)
        for i, value in enumerate(values):
            specs, load = point_specs(args, value, i)
            lengths[f"{value:g}"] = describe(specs)
            label = f"{target.label}@{value:g}"
            result = await measure(target, local, specs, seed=args.seed + 100 * i, label=label, **load)
            local.num_warmup = 0              # one warm-up per cluster
            summary = result[label]
            runs[label] = summary
            points.setdefault(target.label, []).append({"x": value, **{k: summary[k] for k in FIGURES}})
            print(f"{label}: TTFT p50 {summary['ttft_p50_s'] * 1e3:.0f} ms, TPOT p50 "
                  f"{summary['tpot_p50_s'] * 1e3:.1f} ms, goodput {summary['goodput_rps']:.2f} req/s, "
                  f"SLO attainment {summary['slo_attainment'] * 100:.0f}%", file=sys.stderr)
        return {}

    await run_variants(args, sweep_target)
    os.makedirs(args.plot_dir, exist_ok=True)
    name = args.sweep.replace("-", "_")
    path = os.path.join(args.plot_dir, f"sweep_{name}_{args.workload}.png")     # one plot dir serves every workload
    title = f"{args.workload} workload, {args.model or 'default model'}"
    if args.sweep == "rate":
        title += f", {slo_line(slo_record(args))}"
        plot_slo_attainment(points, path, title)
    else:
        plot_latency_sweep(points, args.sweep, path, title)
    print_points(args.sweep, points)
    result = {"sweep": args.sweep, "values": values, "workload": args.workload, "lengths": lengths,
              "slo": slo_record(args), "points": points, "plot": path, "runs": runs}
    if args.sweep == "rate":
        result["capacity"] = capacity
        result["max_rate_rps"] = {variant: max_rate_rps(rows) for variant, rows in points.items()}
        for variant, m in result["max_rate_rps"].items():
            print(f"{variant}: max rate at >= 90% SLO attainment {m['max_rate_rps']:.2f} req/s"
                  f"{'' if m['bounded'] else ' (every rate held it: a lower bound)'}", file=sys.stderr)
    print(f"wrote {path}", file=sys.stderr)
    return result


def print_points(variable: str, points: dict[str, list[dict]]) -> None:
    print(f"\nsweep over {variable}")
    print(f"{'variant':<20} {variable:>12} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'goodput':>8} {'SLO att.':>8}")
    for variant, rows in points.items():
        for r in rows:
            print(f"{variant:<20} {r['x']:>12g} {_ms(r['ttft_p50_s']):>9} {_ms(r['ttft_p99_s']):>9} "
                  f"{_ms(r['tpot_p50_s']):>9} {_ms(r['tpot_p99_s']):>9} {r['goodput_rps']:>8.2f} "
                  f"{r['slo_attainment'] * 100:>7.0f}%")


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.1f}"
