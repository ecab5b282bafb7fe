"""Tables of serving runs: text for the terminal, Markdown for docs/benchmarks/serving.md."""
from __future__ import annotations

import math

from bench.serving.timeline_view import table_rows

# (label, key, unit scale, format)
ROWS = [
    ("completed", "completed", 1, "{:.0f}"),
    ("failed", "failed", 1, "{:.0f}"),
    ("request throughput (req/s)", "request_throughput_rps", 1, "{:.2f}"),
    ("output throughput (tok/s)", "throughput_tokens_s", 1, "{:.1f}"),
    ("goodput (req/s)", "goodput_rps", 1, "{:.2f}"),
    ("SLO attainment", "slo_attainment", 100, "{:.0f}%"),
    ("TTFT mean (ms)", "ttft_mean_s", 1e3, "{:.0f}"),
    ("TTFT p50 (ms)", "ttft_p50_s", 1e3, "{:.0f}"),
    ("TTFT p90 (ms)", "ttft_p90_s", 1e3, "{:.0f}"),
    ("TTFT p99 (ms)", "ttft_p99_s", 1e3, "{:.0f}"),
    ("  queue mean (ms)", "queue_mean_s", 1e3, "{:.0f}"),
    ("  prefill mean (ms)", "prefill_mean_s", 1e3, "{:.0f}"),
    ("  KV transfer mean (ms)", "kv_transfer_mean_s", 1e3, "{:.1f}"),
    ("  decode queue mean (ms)", "decode_queue_mean_s", 1e3, "{:.1f}"),
    *table_rows(),
    ("TPOT mean (ms)", "tpot_mean_s", 1e3, "{:.1f}"),
    ("TPOT p50 (ms)", "tpot_p50_s", 1e3, "{:.1f}"),
    ("TPOT p90 (ms)", "tpot_p90_s", 1e3, "{:.1f}"),
    ("TPOT p99 (ms)", "tpot_p99_s", 1e3, "{:.1f}"),
    ("ITL p50 (ms)", "itl_p50_s", 1e3, "{:.1f}"),
    ("ITL p99 (ms)", "itl_p99_s", 1e3, "{:.1f}"),
    ("E2E p50 (ms)", "e2e_p50_s", 1e3, "{:.0f}"),
    ("E2E p99 (ms)", "e2e_p99_s", 1e3, "{:.0f}"),
    ("prefix-cache hit rate", "prefix_hit_rate", 100, "{:.1f}%"),
    ("KV bytes moved (MiB)", "kv_bytes", 1 / 2**20, "{:.2f}"),
    ("KV wire bytes (MiB)", "kv_wire_bytes", 1 / 2**20, "{:.2f}"),
]
LOWER_IS_BETTER = ("ttft", "tpot", "itl", "e2e", "queue", "prefill", "kv_transfer", "decode_queue", "failed",
                   "timeline")


def cell(run: dict, key: str, scale: float, fmt: str) -> str:
    value = run.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return fmt.format(value * scale)


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b or any(isinstance(x, float) and math.isnan(x) for x in (a, b)):
        return "–"
    return f"{a / b:.2f}×"


def table(runs: dict[str, dict], ratio_of: str | None = None, markdown: bool = False) -> str:
    """Runs side by side; with ``ratio_of``, a column ``ratio_of / other`` per other run."""
    names = list(runs)
    others = [n for n in names if ratio_of in runs and n.startswith("colocated") and not n.endswith("-warm")]
    header = ["metric", *names, *(f"{ratio_of} / {o}" for o in others)]
    rows = []
    for label, key, scale, fmt in ROWS:
        if not any(key in runs[n] for n in names):
            continue
        row = [label, *(cell(runs[n], key, scale, fmt) for n in names)]
        row += [ratio(runs[ratio_of].get(key), runs[o].get(key)) for o in others]
        rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(out)


def lengths_line(lengths: dict) -> str:
    i, o = lengths["input_len"], lengths["output_len"]
    return (f"input tokens min/p50/mean/p90/max {i['min']}/{i['p50']}/{i['mean']}/{i['p90']}/{i['max']}; "
            f"output tokens {o['min']}/{o['p50']}/{o['mean']}/{o['p90']}/{o['max']}")


def max_rate_at_attainment(points: list[dict], goal: float = 0.9) -> tuple[float, str]:
    """DistServe's goodput: the highest request rate whose SLO attainment is >= ``goal``.

    ``points``: {"x": rate, "slo_attainment": share} of one variant. Linear between the last
    rate that holds the goal and the next that does not; (rate, "") — or (highest rate, ">=")
    when every rate holds, (lowest rate, "<") when none does.
    """
    pts = sorted((p["x"], p["slo_attainment"]) for p in points if p.get("slo_attainment") is not None)
    if not pts or pts[0][1] < goal:
        return (pts[0][0] if pts else math.nan), "<"
    for (x0, a0), (x1, a1) in zip(pts, pts[1:]):
        if a1 < goal:
            return x0 + (x1 - x0) * (a0 - goal) / (a0 - a1), ""
    return pts[-1][0], ">="


def targets(runs: dict[str, dict], low_load: dict[str, dict] | None = None,
            rates: dict[str, list[dict]] | None = None) -> list[tuple[str, str, bool | None]]:
    """The three serving targets on `mixed`: (statement, measured, met?).

    Goodput is judged both ways: per run at the loaded rate (requests/s meeting both SLOs)
    and, given the rate curve, as DistServe's highest rate held at >= 90% attainment."""
    out = []
    d, c, cc = runs.get("disaggregated"), runs.get("colocated"), runs.get("colocated-chunked")
    if d and c:
        r = d["tpot_p99_s"] / c["tpot_p99_s"] if c["tpot_p99_s"] else math.nan
        out.append(("disaggregated p99 TPOT ≤ 0.5× colocated (no chunking)", f"{r:.2f}×", r <= 0.5))
    if d and c and cc:
        best = max(c["goodput_rps"], cc["goodput_rps"])
        r = d["goodput_rps"] / best if best else math.inf
        out.append(("disaggregated goodput ≥ 1.3× the better colocated variant (per run, requests/s "
                    "meeting both SLOs at the loaded rate)", f"{r:.2f}×", r >= 1.3))
    if rates and all(k in rates for k in ("disaggregated", "colocated", "colocated-chunked")):
        held = {k: max_rate_at_attainment(v) for k, v in rates.items()}
        best = max(held["colocated"][0], held["colocated-chunked"][0])
        r = held["disaggregated"][0] / best if best else math.inf
        shown = ", ".join(f"{k} {mark}{x:.2f}" for k, (x, mark) in held.items())
        out.append(("disaggregated goodput ≥ 1.3× the better colocated variant (DistServe: highest "
                    f"req/s held at ≥ 90% SLO attainment; {shown})", f"{r:.2f}×",
                    r >= 1.3 and held["disaggregated"][1] != "<"))
    if low_load and "disaggregated" in low_load:
        base = [v["ttft_p50_s"] for k, v in low_load.items() if k.startswith("colocated")]
        if base:
            r = low_load["disaggregated"]["ttft_p50_s"] / min(base)
            out.append(("low-load p50 TTFT ≤ 1.3× colocated", f"{r:.2f}×", r <= 1.3))
    return out
