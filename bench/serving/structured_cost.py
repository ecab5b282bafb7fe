"""What a grammar mask costs a decode step: TPOT with and without structured output, side by side.

    pdserve bench serve --embedded --workload structured --batch-sizes 1,32 --num-requests 32 --scale 0.5

For each batch size b, the same requests (the ``structured`` workload: short prompts, a fixed output length,
greedy, ``ignore_eos``) run closed-loop at concurrency b, once free and once held to `STRUCTURED_SCHEMA`
(an array of records no output completes, so every constrained step computes a live mask). The two runs
alternate (``REPEATS`` each, their records pooled), so drift in the machine's speed hits both alike.
Overhead = TPOT constrained / TPOT free - 1: the mask's share of a step (the batched bitmask fill on
llguidance's threads, the one-op apply, the matcher's advance), as the client sees it.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from bench.serving.load import run_load
from bench.serving.metrics import summarize
from bench.serving.runs import open_client, run_variants, workload_kwargs
from bench.serving.workloads import STRUCTURED, STRUCTURED_SCHEMA, describe, make_workload

REPEATS = 2
VARIANTS = ("free", "structured")


def batch_sizes(value: str) -> list[int]:
    """``--batch-sizes 1,32`` → [1, 32]."""
    try:
        sizes = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes: expected positive integers like 1,32; got {value!r}")
    return sizes


async def measure(target, args: argparse.Namespace) -> dict:
    """TPOT of the free and the constrained runs per batch size against ``target`` (its first front door)."""
    api = (target.apis or (args.api.split(",")[0].strip(),))[0]
    client = await open_client(target, api)
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    rows = []
    try:
        warm = make_workload(STRUCTURED, max(args.num_warmup, 1), args.seed + 10_000, **workload_kwargs(args))
        for specs in (warm, [dataclasses.replace(s, structured=None) for s in warm]):    # compile, and warm up
            await run_load(client, specs, concurrency=len(specs), seed=args.seed, tag="warmup", progress=False,
                           timeout=args.timeout)
        for size in batch_sizes(args.batch_sizes):
            specs = make_workload(STRUCTURED, max(args.num_requests, size), args.seed + size, **workload_kwargs(args))
            runs = {"free": [dataclasses.replace(s, structured=None) for s in specs], "structured": specs}
            records: dict[str, list] = {v: [] for v in VARIANTS}
            durations = dict.fromkeys(VARIANTS, 0.0)
            for repeat in range(REPEATS):
                for variant in VARIANTS:
                    got, duration = await run_load(
                        client, runs[variant], concurrency=size, seed=args.seed, tag=f"b{size}-{variant}-{repeat}",
                        label=f"batch {size} {variant} ({repeat + 1}/{REPEATS})", progress=not args.no_progress,
                        timeout=args.timeout)
                    records[variant] += got
                    durations[variant] += duration
            row = {"batch": size, "api": client.api}
            for variant in VARIANTS:
                summary = summarize(records[variant], durations[variant], *slo)
                row[variant] = {k: summary[k] for k in ("completed", "failed", "tpot_mean_s", "tpot_p50_s",
                                                        "tpot_p90_s", "throughput_tokens_s")}
            row["overhead"] = row["structured"]["tpot_mean_s"] / row["free"]["tpot_mean_s"] - 1
            rows.append(row)
    finally:
        await client.close()
    failed = sum(row[v]["failed"] for row in rows for v in VARIANTS)
    return {target.label: {"rows": rows, "failed": failed}}


async def bench_structured(args: argparse.Namespace) -> dict:
    specs = make_workload(STRUCTURED, args.num_requests, args.seed, **workload_kwargs(args))
    print(f"workload structured: {args.num_requests} requests per batch size and run, schema: array of >= "
          f"{STRUCTURED_SCHEMA['minItems']} records", file=sys.stderr)
    runs = await run_variants(args, lambda target: measure(target, args))
    return {"workload": STRUCTURED, "lengths": describe(specs), "batch_sizes": batch_sizes(args.batch_sizes),
            "repeats": REPEATS, "seed": args.seed, "runs": runs}


def table(result: dict, markdown: bool = False) -> str:
    """Per variant and batch size: TPOT free vs constrained, and the overhead."""
    header = ["variant", "batch", "TPOT free mean (ms)", "TPOT structured mean (ms)", "TPOT free p50 (ms)",
              "TPOT structured p50 (ms)", "mask overhead"]
    lines = []
    for name, run in result["runs"].items():
        for row in run["rows"]:
            free, constrained = row["free"], row["structured"]
            lines.append([name, str(row["batch"]), f"{free['tpot_mean_s'] * 1e3:.2f}",
                          f"{constrained['tpot_mean_s'] * 1e3:.2f}", f"{free['tpot_p50_s'] * 1e3:.2f}",
                          f"{constrained['tpot_p50_s'] * 1e3:.2f}", f"{row['overhead'] * 100:+.1f}%"])
    if markdown:
        return "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *lines])
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [header, *lines])
