"""Serving benchmark: latency, throughput and goodput of pdserve under a workload (`python -m bench.serving`).

    cli.py             flags, one run or a comparison of variants, the printed table and JSON
    runs.py            one measured run against a target; the same run over every variant
    sweep.py           a swept variable (lengths, concurrency, rate) per variant, as PNGs
    cluster.py         targets: a running router or an embedded cluster per serving variant
    workloads.py       the requests: chat, rag, mixed, shared-prefix, structured or a JSONL file
    structured_cost.py TPOT with and without a structured-output mask, per batch size
    load.py            the load generator and each request's client-side record
    metrics.py         the figures of a run (TTFT, TPOT, ITL, goodput) and the router's counters
    tables.py          text and Markdown tables of runs, the serving targets
    plots.py           PNG plots of sweeps
    hf.py              the peer: Hugging Face `generate` with static batching
    plan_check.py      the planner's predictions against a running cluster
    stream_latency.py  Ray streaming generator vs gRPC server stream, per-token delay
"""
from bench.serving.cli import main
from bench.serving.cluster import Target
from bench.serving.load import RequestRecord
from bench.serving.metrics import summarize
from bench.serving.runs import measure
from bench.serving.workloads import RequestSpec, describe, make_workload

__all__ = ["RequestRecord", "RequestSpec", "Target", "describe", "main", "make_workload", "measure", "summarize"]
