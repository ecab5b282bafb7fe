"""`docs/benchmarks/serving.md`: the serving benchmark suite, run once, written as Markdown + PNGs.

    python -m bench.report [--preset small|tiny] [--out docs/benchmarks/serving.md] [--img-dir docs/benchmarks/img]
    python -m bench.report --from-json results.json      # re-render without running

Per serving variant (one embedded cluster each, equal total actors):

1. low load: `mixed`, one request at a time (TTFT without queueing);
2. loaded: `mixed` at a Poisson rate — the side-by-side table and the targets;
3. SLO attainment and goodput against the request rate (PNG);
4. `shared-prefix`, cold then warm prefix cache (disaggregated);
5. sweeps of output length, prompt length and concurrency, TTFT/TPOT per variant (PNGs);
6. offline throughput (all requests at once) beside HF transformers static batching.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

from bench.report.markdown import render_markdown
from bench.serving.cli import build_parser
from bench.serving.strict_json import clean_json
from bench.serving.cluster import bench_config, embedded
from bench.serving.plots import plot_latency_sweep, plot_slo_attainment
from bench.serving.runs import measure
from bench.serving.sweep import FIGURES, point_specs
from bench.serving.workloads import describe, make_workload

VARIANTS = ("colocated", "colocated-chunked", "disaggregated")


@dataclass
class Plan:
    model: str = "small"
    scale: float = 0.25                    # lengths: chat 16-64 in / 32-96 out, rag 256-512 in / 4-16 out
    # TPOT: the serving bench's default, 10 tokens/s (a chat reader's pace); TTFT: one core prefills
    # a 400-token RAG prompt of this workload in ~0.7 s alone, so 3 s leaves room for queueing
    slo_ttft_ms: float = 3000.0
    slo_tpot_ms: float = 100.0
    low_load_requests: int = 4
    loaded_requests: int = 48
    loaded_rate: float = 5.0               # also one point of the SLO-vs-rate curve
    rates: tuple[float, ...] = (2.0, 3.5, 6.5)
    rate_requests: int = 32
    prefix_requests: int = 8
    sweep_variants: tuple[str, ...] = ("colocated", "disaggregated")
    sweeps: dict = field(default_factory=lambda: {
        "output-len": "16,48,128", "prompt-len": "64,256,512", "concurrency": "1,4,16"})
    sweep_requests: int = 4
    throughput_requests: int = 12
    hf_batch_size: int = 8
    sets: tuple[str, ...] = (
        "pools.prefill.resources.num_cpus=1", "pools.decode.resources.num_cpus=1",
        "pools.prefill.resources.torch_threads=1", "pools.decode.resources.torch_threads=1",
        "kv_cache.num_blocks=768", "model.dtype=float32",
    )
    # each pool its own batch policy: the prefill actor keeps pools.yaml's 512-token chunks (nothing
    # to protect), a colocated-chunked engine cuts prompts into 64-token chunks between decode steps
    colocated_chunk_tokens: int | None = 64


PRESETS = {
    "small": Plan(),
    "tiny": Plan(model="tiny", scale=0.1, slo_ttft_ms=500.0, slo_tpot_ms=50.0, loaded_requests=16, loaded_rate=8.0,
                 rates=(4.0, 16.0), rate_requests=8, prefix_requests=6, sweep_requests=4,
                 sweeps={"concurrency": "1,4"}, throughput_requests=8,
                 colocated_chunk_tokens=16,
                 sets=("kv_cache.num_blocks=256", "model.dtype=float32",
                       "pools.prefill.resources.torch_threads=1", "pools.decode.resources.torch_threads=1")),
}


def bench_args(plan: Plan, *extra: str):
    argv = ["--embedded", "--model", plan.model, "--scale", str(plan.scale), "--slo-ttft-ms", str(plan.slo_ttft_ms),
            "--slo-tpot-ms", str(plan.slo_tpot_ms), "--num-warmup", "0", "--no-progress", *extra]
    for item in plan.sets:
        argv += ["--set", item]
    return build_parser().parse_args(argv)


def strip(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "records"}


async def run_variant(plan: Plan, variant: str, out: dict) -> None:
    """Every experiment of the suite that runs against ``variant``, on one cluster."""
    base = bench_args(plan)
    cfg = bench_config(base.config, base.model, base.dtype, base.set, variant, plan.colocated_chunk_tokens)
    async with embedded(cfg, variant) as target:
        warm = bench_args(plan, "--workload", "chat", "--num-warmup", "2", "--num-requests", "0")
        await measure(target, warm, [], seed=99, label="warmup", concurrency=2)

        a = bench_args(plan, "--workload", "mixed")
        specs = make_workload("mixed", plan.low_load_requests, 1, plan.scale)
        res = await measure(target, a, specs, seed=1, label=variant, concurrency=1)
        out["low_load"][variant] = strip(res[variant])
        out["workloads"]["mixed (low load)"] = describe(specs)

        specs = make_workload("mixed", plan.loaded_requests, 0, plan.scale)
        res = await measure(target, a, specs, seed=0, label=variant, request_rate=plan.loaded_rate)
        out["loaded"][variant] = strip(res[variant])
        out["records"][variant] = res[variant]["records"]
        out["workloads"]["mixed"] = describe(specs)

        points = [{"x": plan.loaded_rate, **{k: out["loaded"][variant][k] for k in FIGURES}}]
        for i, rate in enumerate(plan.rates):
            specs = make_workload("mixed", plan.rate_requests, 10 + i, plan.scale)
            s = (await measure(target, a, specs, seed=10 + i, label="r", request_rate=rate))["r"]
            points.append({"x": rate, **{k: s[k] for k in FIGURES}})
        out["rates"][variant] = sorted(points, key=lambda p: p["x"])
        print(f"{variant}: loaded and rate runs done", file=sys.stderr, flush=True)

        if variant == "disaggregated":
            p = bench_args(plan, "--workload", "shared-prefix", "--cache", "cold,warm")
            specs = make_workload("shared-prefix", plan.prefix_requests, 0, plan.scale, output_len=8)
            res = await measure(target, p, specs, seed=0, label=variant, concurrency=4)
            out["prefix"] = {k: strip(v) for k, v in res.items()}
            out["workloads"]["shared-prefix"] = describe(specs)

        if variant in plan.sweep_variants:
            for sweep, values in plan.sweeps.items():
                s_args = bench_args(plan, "--workload", "chat", "--sweep", sweep, "--num-requests",
                                    str(plan.sweep_requests))
                for i, value in enumerate(float(v) for v in values.split(",")):
                    specs, load = point_specs(s_args, value, i)
                    s = (await measure(target, s_args, specs, seed=100 * i, label="s", **load))["s"]
                    out["sweeps"].setdefault(sweep, {}).setdefault(variant, []).append(
                        {"x": value, **{k: s[k] for k in FIGURES}})
                    print(f"{variant} {sweep}={value:g}: TTFT p50 {s['ttft_p50_s'] * 1e3:.0f} ms, TPOT p50 "
                          f"{s['tpot_p50_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)

        if variant in ("colocated-chunked", "disaggregated"):
            t = bench_args(plan, "--workload", "chat")
            specs = make_workload("chat", plan.throughput_requests, 5, plan.scale)
            out["throughput"][variant] = strip((await measure(target, t, specs, seed=5, label=variant))[variant])
            out["workloads"]["chat (offline)"] = describe(specs)


def run_hf(plan: Plan, out: dict) -> None:
    from bench.serving.hf import hf_static_batching
    base = bench_args(plan)
    cfg = bench_config(base.config, base.model, base.dtype, base.set)
    specs = make_workload("chat", plan.throughput_requests, 5, plan.scale)
    out["throughput"]["hf-static"] = hf_static_batching(cfg, specs, plan.hf_batch_size)


KEPT_SECTIONS = ("## Chaos run",)   # written by other benchmarks' own reports: carried over as they are


def kept_sections(path: str) -> str:
    """The sections of an existing page that this report does not write (from the first of them on)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    starts = [text.index(h) for h in KEPT_SECTIONS if h in text]
    return "\n" + text[min(starts):] if starts else ""


def machine_info() -> dict:
    import platform
    import subprocess
    from importlib.metadata import version

    import grpc
    import torch
    import transformers
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = "?"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem, 1), "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "ray": version("ray"),
            "grpcio": grpc.__version__, "transformers": transformers.__version__, "commit": commit,
            "load_before": os.getloadavg()}


async def run_suite(plan: Plan) -> dict:
    out: dict = {"plan": asdict(plan), "machine": machine_info(), "low_load": {}, "loaded": {}, "rates": {},
                 "prefix": {}, "sweeps": {}, "throughput": {}, "records": {}, "workloads": {}}
    start = time.monotonic()
    for variant in VARIANTS:
        print(f"== {variant} ({time.monotonic() - start:.0f}s)", file=sys.stderr, flush=True)
        await run_variant(plan, variant, out)
    out["machine"]["load_after"] = os.getloadavg()
    out["wall_s"] = time.monotonic() - start
    return out


def write_plots(result: dict, img_dir: str) -> dict[str, str]:
    os.makedirs(img_dir, exist_ok=True)
    model = result["plan"]["model"]
    plan = result["plan"]
    paths = {}
    if result["rates"]:
        paths["rate"] = plot_slo_attainment(
            result["rates"], os.path.join(img_dir, "serve_slo_vs_rate.png"),
            f"mixed, {model}: SLO TTFT {plan['slo_ttft_ms']:.0f} ms / TPOT {plan['slo_tpot_ms']:.0f} ms")
    for sweep, points in result["sweeps"].items():
        name = sweep.replace("-", "_")
        paths[sweep] = plot_latency_sweep(points, sweep, os.path.join(img_dir, f"serve_sweep_{name}.png"),
                                          f"chat, {model}: TTFT / TPOT vs {sweep}")
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--out", default="docs/benchmarks/serving.md")
    p.add_argument("--img-dir", default="docs/benchmarks/img")
    p.add_argument("--json", help="save the raw results (with per-request records) here")
    p.add_argument("--from-json", help="render saved results instead of running")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
    else:
        plan = PRESETS[args.preset]
        result = asyncio.run(run_suite(plan))
        if not args.no_hf:
            run_hf(plan, result)
        result = clean_json(result)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
    plots = write_plots(result, args.img_dir)
    rel = {k: os.path.relpath(v, os.path.dirname(os.path.abspath(args.out))) for k, v in plots.items()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    kept = kept_sections(args.out)
    with open(args.out, "w") as f:
        f.write(render_markdown(result, rel) + kept)
    print(f"wrote {args.out} and {len(plots)} plots in {args.img_dir}", file=sys.stderr)
    return 0

