"""Figures of one serving run from its per-request records (and the router's /metrics).

Definitions (as vLLM's serving benchmark and DistServe use them):

- TTFT: send → first token message, at the client.
- TPOT: (E2E − TTFT) / (output tokens − 1) per request — excludes the first token.
- ITL: every gap between consecutive token messages, pooled over requests.
- goodput: completed requests with TTFT ≤ SLO_TTFT **and** TPOT ≤ SLO_TPOT, divided by
  the run's duration (requests/s); ``slo_attainment`` is that count over all requests sent.
- prefix-cache hit rate: Σ cached prompt tokens / Σ prompt tokens (from each Usage).
"""
from __future__ import annotations

import math
import statistics
import urllib.request
from collections.abc import Iterable, Sequence

from bench.serving.load import RequestRecord
from bench.serving.slo_scale import slo_of
from bench.serving.timeline_view import stage_means

PERCENTILES = (50, 90, 99)
KV_COUNTERS = {
    "kv_bytes": "pdserve_kv_transfer_bytes_total",
    "kv_wire_bytes": "pdserve_kv_wire_bytes_total",
    "prefix_hit_tokens": "pdserve_prefix_cache_hit_tokens_total",
    "transfer_failures": "pdserve_transfer_failures_total",
    "local_prefills": "pdserve_local_prefills_total",
    "placed_local": 'pdserve_placement_decisions_total{choice="local"}',      # routing.mode auto
    "placed_remote": 'pdserve_placement_decisions_total{choice="remote"}',
}


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def distribution(name: str, values: Sequence[float]) -> dict[str, float]:
    """``{name_mean_s, name_p50_s, name_p90_s, name_p99_s}``."""
    out = {f"{name}_mean_s": statistics.fmean(values) if values else math.nan}
    out.update({f"{name}_p{p}_s": percentile(values, p) for p in PERCENTILES})
    return out


def meets_slo(r: RequestRecord, slo_ttft_s: float, slo_tpot_s: float, class_slos: dict | None = None) -> bool:
    """Both SLOs met: the fixed pair, or the record's class's (`bench.serving.slo_scale`)."""
    ttft, tpot = slo_of(r, class_slos, slo_ttft_s, slo_tpot_s)
    return r.ok and r.ttft_s <= ttft and r.tpot_s <= tpot


def goodput(records: Iterable[RequestRecord], duration_s: float, slo_ttft_s: float, slo_tpot_s: float,
            class_slos: dict | None = None) -> float:
    """Requests per second that finished meeting both SLOs."""
    good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s, class_slos) for r in records)
    return good / duration_s if duration_s > 0 else 0.0


def summarize(records: list[RequestRecord], duration_s: float, slo_ttft_s: float, slo_tpot_s: float,
              class_slos: dict | None = None) -> dict:
    """Every figure of one run (flat dict of floats and ints); ``class_slos`` (--slo-scale) replaces the
    fixed SLO pair per request class."""
    done = [r for r in records if r.ok]
    out: dict = {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": duration_s,
        "request_throughput_rps": len(done) / duration_s if duration_s > 0 else 0.0,
        "throughput_tokens_s": sum(r.num_output_tokens for r in done) / duration_s if duration_s > 0 else 0.0,
        "total_tokens_s": sum(r.num_output_tokens + r.prompt_len for r in done) / duration_s if duration_s else 0.0,
    }
    out.update(distribution("ttft", [r.ttft_s for r in done]))
    out.update(distribution("tpot", [r.tpot_s for r in done if r.num_output_tokens > 1]))
    out.update(distribution("itl", [g for r in done for g in r.itl_s]))
    out.update(distribution("e2e", [r.e2e_s for r in done]))
    for part in ("queue", "prefill", "kv_transfer", "decode_queue"):
        values = [getattr(r, f"{part}_s") for r in done]
        out[f"{part}_mean_s"] = statistics.fmean(values) if values else math.nan
        out[f"{part}_p99_s"] = percentile(values, 99)
    out.update(stage_means(records))
    out["goodput_rps"] = goodput(records, duration_s, slo_ttft_s, slo_tpot_s, class_slos)
    out["slo_attainment"] = sum(meets_slo(r, slo_ttft_s, slo_tpot_s, class_slos) for r in records) / \
        max(len(records), 1)
    prompt = sum(r.prompt_len for r in done)
    out["prefix_hit_rate"] = sum(r.cached_prompt_tokens for r in done) / prompt if prompt else 0.0
    out["errors"] = sorted({r.error for r in records if not r.ok})[:5]
    return out


def parse_counters(text: str) -> dict[str, float]:
    """Sum of each KV/prefix counter in a Prometheus exposition (all label sets)."""
    out = dict.fromkeys(KV_COUNTERS, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        labelled = line.rsplit(" ", 1)[0]
        for key, metric in KV_COUNTERS.items():
            if name == metric or labelled == metric:
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def scrape(metrics_url: str | None, token: str | None = None, timeout: float = 5.0) -> dict[str, float] | None:
    """The router's KV counters now, or None without a URL or when unreachable.
    `token`: the bearer token a protected /metrics asks for."""
    if not metrics_url:
        return None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(metrics_url, headers=headers), timeout=timeout) as r:
            return parse_counters(r.read().decode())
    except OSError:
        return None


def counter_delta(before: dict | None, after: dict | None) -> dict[str, float]:
    """Counters moved during a run (nan when the router's metrics were not reachable)."""
    if before is None or after is None:
        return dict.fromkeys(KV_COUNTERS, math.nan)
    return {k: after[k] - before[k] for k in KV_COUNTERS}
