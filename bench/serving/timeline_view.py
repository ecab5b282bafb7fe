"""The TTFT timeline in the serving benchmark: mean per stage over a run, and one request drawn stage by stage.

Every request's last gRPC message carries the server's `Timeline` (router/timing.py): the
stages from the router's receipt to its first token, summing to the router's TTFT. The
client adds one more, ``client ↔ router`` (its TTFT less the router's: the request's way in
and the first token's way out), so the rows below sum to the TTFT the client measured.
"""
from __future__ import annotations

import math
import statistics

from router.timing import STAGES

CLIENT = ("client_s", "client", "client's TTFT − router's TTFT: the request in and the first token out")
ROWS = (*STAGES, CLIENT)
BAR_WIDTH = 40


def stage_means(records: list) -> dict[str, float]:
    """``timeline_<stage>_mean_s`` over the completed records that carry a timeline (nan without any)."""
    timed = [r for r in records if r.ok and r.timeline]
    out = {}
    for name, _, _ in ROWS:
        values = [r.client_s if name == "client_s" else r.timeline[name] for r in timed]
        out[f"timeline_{name}_mean"] = statistics.fmean(values) if values else math.nan
    out["timeline_requests"] = len(timed)
    return out


def table_rows() -> list[tuple[str, str, float, str]]:
    """Rows of the benchmark table (label, key, unit scale, format): one per stage, then their sum."""
    rows = [(f"  {name[:-2].replace('_', ' ')} (ms)", f"timeline_{name}_mean", 1e3, "{:.1f}") for name, _, _ in ROWS]
    return [("TTFT timeline, mean per stage:", "timeline_requests", 1, "{:.0f} requests"), *rows]


def median_request(records: list[dict]) -> dict | None:
    """Of a run's records (as in its JSON), the completed one with a timeline whose TTFT is the median."""
    timed = sorted((r for r in records if r["ok"] and r.get("timeline")), key=lambda r: r["ttft_s"])
    return timed[len(timed) // 2] if timed else None


def render(record: dict) -> str:
    """One request's path to its first token (a record as in the run's JSON): a line per stage with its
    offset, duration and a bar."""
    ttft = record["ttft_s"]
    lines = [f"request {record['request_id']}: TTFT {ttft * 1e3:.1f} ms at the client "
             f"({record['server_ttft_s'] * 1e3:.1f} ms at the router)"]
    at = 0.0
    for name, where, what in ROWS:
        seconds = record["client_s"] if name == "client_s" else record["timeline"][name]
        start = int(round(BAR_WIDTH * at / ttft)) if ttft > 0 else 0
        width = int(round(BAR_WIDTH * max(seconds, 0.0) / ttft)) if ttft > 0 else 0
        bar = " " * min(start, BAR_WIDTH) + "█" * max(width, 1 if seconds > 0 else 0)
        lines.append(f"  {name[:-2]:<18} {where:<8} +{at * 1e3:8.1f} {seconds * 1e3:8.1f} ms  "
                     f"|{bar:<{BAR_WIDTH}}|  {what}")
        at += seconds
    t = record["timeline"]
    if t.get("kv_chunks"):
        chunks = ", ".join(f"{s * 1e3:.1f}" for s in t["kv_chunk_s"][:16])
        lines.append(f"  KV: {t['kv_chunks']} chunk(s) handed to the transport at +[{chunks}] ms after the "
                     f"first token; whole send (to the receiver's ack) {t['kv_send_total_s'] * 1e3:.1f} ms, "
                     f"whole receive (first chunk → done) {t['kv_receive_total_s'] * 1e3:.1f} ms")
    lines.append(f"  sum of stages {at * 1e3:.1f} ms = client TTFT {ttft * 1e3:.1f} ms")
    return "\n".join(lines)
