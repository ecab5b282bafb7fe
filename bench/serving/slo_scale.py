"""SLOs and rates that mean the same on any machine (DistServe's SLO scale and capacity sweep).

``--slo-scale S``: each request class's (a workload's ``kind``: chat, rag, ...) TTFT and TPOT SLOs
are S × what a request of that class takes alone on the same machine, measured at the start of the
benchmark (`calibrate`: a few requests of each class one at a time on the first variant's cluster,
medians), so a 4× scale asks the same of a GPU node and of a 2-core laptop. The absolute SLOs are
printed and written to the JSON.

``--sweep rate`` without values: `capacity_rps` (a closed burst on the first variant) sets the rates
(`RATE_FRACTIONS` of it), and `max_rate_rps` reads the highest offered rate held at >= 90% SLO
attainment off each variant's curve (linear between the points that bracket 90%; from (0, 100%) when
even the lowest rate misses it; the highest rate, flagged, when every rate holds it).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from bench.serving.load import RequestRecord, run_load
from bench.serving.workloads import RequestSpec

ALONE_PER_CLASS = 3                     # requests of each class timed alone
RATE_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25)
ATTAINMENT = 0.9


async def calibrate(client, specs: list[RequestSpec], scale: float, timeout: float) -> dict[str, dict]:
    """{kind: {alone_ttft_s, alone_tpot_s, ttft_s, tpot_s}}: per class, the median of requests sent
    one at a time, and S × each (the class's SLOs)."""
    out: dict[str, dict] = {}
    for kind in dict.fromkeys(s.kind for s in specs):
        sample = [s for s in specs if s.kind == kind][:ALONE_PER_CLASS]
        records, _ = await run_load(client, sample, concurrency=1, tag=f"alone-{kind}", progress=False,
                                    timeout=timeout)
        done = [r for r in records if r.ok]
        if not done:
            raise RuntimeError(f"--slo-scale: no {kind} request finished alone: {records[0].error}")
        ttft = statistics.median(r.ttft_s for r in done)
        tpot = statistics.median(r.tpot_s for r in done if r.num_output_tokens > 1) if any(
            r.num_output_tokens > 1 for r in done) else ttft
        out[kind] = {"alone_ttft_s": ttft, "alone_tpot_s": tpot, "ttft_s": scale * ttft, "tpot_s": scale * tpot}
    print("SLOs at scale " + f"{scale:g}: " + "; ".join(
        f"{k} TTFT {v['ttft_s'] * 1e3:.0f} ms / TPOT {v['tpot_s'] * 1e3:.1f} ms (alone {v['alone_ttft_s'] * 1e3:.0f} / "
        f"{v['alone_tpot_s'] * 1e3:.1f} ms)" for k, v in out.items()), file=sys.stderr)
    return out


def slo_of(record: RequestRecord, class_slos: dict[str, dict] | None, ttft_s: float, tpot_s: float
           ) -> tuple[float, float]:
    """The (TTFT, TPOT) SLO a record is held to: its class's when scaled, else the fixed pair."""
    if class_slos and record.kind in class_slos:
        c = class_slos[record.kind]
        return c["ttft_s"], c["tpot_s"]
    return ttft_s, tpot_s


async def capacity_rps(client, specs: list[RequestSpec], timeout: float) -> float:
    """Requests/s the target completes with every request sent at once (its saturated throughput)."""
    records, duration = await run_load(client, specs, tag="capacity", progress=False, timeout=timeout)
    done = sum(r.ok for r in records)
    if not done:
        raise RuntimeError(f"--sweep rate: no request finished in the capacity probe: {records[0].error}")
    return done / duration


def rates_around(capacity: float) -> list[float]:
    return [round(capacity * f, 3) for f in RATE_FRACTIONS]


def max_rate_rps(points: list[dict], threshold: float = ATTAINMENT) -> dict:
    """{max_rate_rps, bounded}: the highest offered rate (``x``) held at >= threshold attainment.

    ``bounded`` False: every measured rate held it (the figure is a lower bound)."""
    pts = sorted((p["x"], p["slo_attainment"]) for p in points)
    prev_x, prev_a = 0.0, 1.0
    for x, a in pts:
        if a < threshold:            # prev_a >= threshold > a: the crossing lies between
            return {"max_rate_rps": prev_x + (x - prev_x) * (prev_a - threshold) / (prev_a - a), "bounded": True}
        prev_x, prev_a = x, a
    return {"max_rate_rps": prev_x, "bounded": False}


def slo_record(args: argparse.Namespace) -> dict:
    """The SLOs of the run: the fixed pair, or per class (--slo-scale) with what each class took alone."""
    if getattr(args, "slo_scale", None):
        return {"scale": args.slo_scale, "by_class": {k: {f"{m.removesuffix('_s')}_ms": v * 1e3 for m, v in c.items()}
                                                      for k, c in args.class_slos.items()}}
    return {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}


def slo_line(slo: dict) -> str:
    if "by_class" in slo:
        return f"SLO scale {slo['scale']:g}: " + "; ".join(
            f"{k} TTFT {c['ttft_ms']:.0f} ms / TPOT {c['tpot_ms']:.1f} ms" for k, c in slo["by_class"].items())
    return f"SLO TTFT {slo['ttft_ms']:.0f} ms / TPOT {slo['tpot_ms']:.0f} ms"


def phase_report(records: list[dict], roles: list[dict], window_s: float = 10.0) -> dict:
    """For the phases workload: when the workload shifted (send time of the first request of each new
    kind), the split after each shift (prefill actors), how long it took to settle (last change within
    the phase), reversals (a change opposite to the one before, within a phase), and SLO attainment
    per window of send time. ``records`` are `RequestRecord.to_dict()`s with ``meets_slo`` set."""
    ordered = sorted(records, key=lambda r: r["sent_at"])
    shifts = [r["sent_at"] for prev, r in zip(ordered, ordered[1:]) if r["kind"] != prev["kind"]]
    bounds = [0.0, *shifts, float("inf")]
    phases = []
    for lo, hi in zip(bounds, bounds[1:]):
        before = [r for r in roles if r["t"] < lo][-1:]           # the split the phase starts from
        seq = before + [r for r in roles if lo <= r["t"] < hi]
        pairs = [(a, b) for a, b in zip(seq, seq[1:]) if a["prefill"] != b["prefill"]]
        steps = [b["prefill"] - a["prefill"] for a, b in pairs]
        reversals = sum(1 for x, y in zip(steps, steps[1:]) if x * y < 0)
        phases.append({"start_s": lo, "prefill_actors": seq[-1]["prefill"] if seq else None,
                       "settled_after_s": (pairs[-1][1]["t"] - lo) if pairs else 0.0, "num_changes": len(pairs),
                       "reversals": reversals})
    end = max((r["sent_at"] for r in ordered), default=0.0)
    attainment = []
    t = 0.0
    while t <= end:
        inside = [r for r in ordered if t <= r["sent_at"] < t + window_s]
        if inside:
            attainment.append((t + window_s / 2, sum(r["meets_slo"] for r in inside) / len(inside)))
        t += window_s
    return {"shifts_s": shifts, "phases": phases, "attainment": attainment}
