"""What the chaos run proves: each request judged against its reference, the figures, the contract.

A request ends as one of:

    exact      finished (stop / length) with the reference's token ids and text
    corrupted  finished with other token ids or text, or ended early with output that is not a prefix
               of the reference's (tokens or text)
    clear      ended early with a clear gRPC status and a correct prefix (CANCELLED only when the client
               cancelled it, DEADLINE_EXCEEDED only for a deadline drill)
    unclear    INTERNAL / UNKNOWN, a stream without a finish, an ABORT finish the client never asked for,
               or CANCELLED the client did not ask for
    hung       still open at the end, or stopped only by its safety deadline (the server never ended it)

Who was hit by a fault (the target: >= 99 % of them exact, the rest a clear status):

    server-side faults  a steady request in flight during one (`drills.SERVER_FAULTS`, from injection
                        to `window_end`) is exposed; it was hit when the router retried or migrated it,
                        or it did not complete exactly
    admission burst     every request sent while a burst was on (by the burst or the steady clients)
                        that the router admitted; those it shed at the door with RESOURCE_EXHAUSTED were
                        never accepted (the contract's overload answer) and are counted apart
    client drills       cancel and deadline requests end as the client asked (or complete first): exact
                        or a clear status, with a correct prefix; they are not in the 99 % figure
"""
from __future__ import annotations

import json
import statistics

from bench.chaos.drills import SERVER_FAULTS, FaultRecord
from bench.chaos.run import RunResult
from bench.chaos.workload import ChaosRequest

UNCLEAR_CODES = ("UNKNOWN", "INTERNAL", "NO_FINISH")
DETECT_TARGET_S = 2.0
EXACT_TARGET = 0.99


def verdict(req: ChaosRequest, out) -> str:
    if out.ended is None:
        return "hung"
    if out.code is None and out.finish_reason in ("stop", "length"):
        same = tuple(out.token_ids) == req.ref_token_ids and out.text == req.ref_text
        return "exact" if same else "corrupted"
    if out.code == "DEADLINE_EXCEEDED" and req.kind != "deadline":
        return "hung"
    if tuple(out.token_ids) != req.ref_token_ids[:len(out.token_ids)] or not req.ref_text.startswith(out.text):
        return "corrupted"
    if out.code is None or out.code in UNCLEAR_CODES or (out.code == "CANCELLED" and not out.cancelled_by_client):
        return "unclear"
    return "clear"


def category(req: ChaosRequest, out, bursts: list[FaultRecord]) -> str:
    """cancel / deadline (the client's drills), burst (sent by a burst, or by the steady clients while
    one was on: both meet a full router), or normal."""
    if req.kind != "normal":
        return req.kind
    during = any(f.injected_at is not None and f.injected_at <= out.started <= (f.window_end or float("inf"))
                 for f in bursts)
    return "burst" if out.burst or during else "normal"


def exposure(out, faults: list[FaultRecord]) -> list[int]:
    """Indexes of the server-side faults whose window overlaps the request's life."""
    end = out.ended if out.ended is not None else float("inf")
    return [i for i, f in enumerate(faults) if f.kind in SERVER_FAULTS and f.injected_at is not None
            and out.started < (f.window_end or float("inf")) and end > f.injected_at]


def _cause(exposed: list[int], faults: list[FaultRecord], first_moved: float | None) -> int | None:
    """The fault a hit request is charged to: the last one injected before the router first moved it
    (windows can overlap by a transfer deadline), else the last it was exposed to."""
    if not exposed:
        return None
    before = [i for i in exposed if first_moved is not None and faults[i].injected_at <= first_moved]
    return (before or exposed)[-1]


def summarize(requests: list[ChaosRequest], result: RunResult) -> dict:
    """Every figure of the run (the JSON report's `figures`)."""
    by_index = {r.index: r for r in requests}
    moved: dict[str, float] = {}                     # request id -> its first retry or migration
    for t, rid, _ in result.router_events:
        moved.setdefault(rid, t)
    bursts = [f for f in result.faults if f.kind == "burst"]
    rows = []
    for index, out in sorted(result.outcomes.items()):
        req = by_index[index]
        kind = category(req, out, bursts)
        exposed = exposure(out, result.faults) if kind == "normal" else []
        v = verdict(req, out)
        if kind == "burst":                 # admitted into a full router: hit by the burst
            hit = out.code != "RESOURCE_EXHAUSTED"
        else:
            hit = bool(exposed) and (req.request_id in moved or v != "exact")
        rows.append(dict(index=index, request_id=req.request_id, category=kind, verdict=v,
                         code=out.code, finish_reason=out.finish_reason, exposed=exposed,
                         cause=_cause(exposed, result.faults, moved.get(req.request_id)) if hit else None,
                         moved=req.request_id in moved, hit=hit,
                         num_tokens=len(out.token_ids), ref_tokens=len(req.ref_token_ids),
                         seconds=None if out.ended is None else round(out.ended - out.started, 3),
                         details=out.details[:200]))
    unsent = len(requests) - len(rows)

    def count(rs, **want) -> int:
        return sum(1 for r in rs if all(r[k] == v for k, v in want.items()))
    hit = [r for r in rows if r["hit"]]
    normal = [r for r in rows if r["category"] == "normal"]
    burst = [r for r in rows if r["category"] == "burst"]
    cancel = [r for r in rows if r["category"] == "cancel"]
    deadline = [r for r in rows if r["category"] == "deadline"]
    undisturbed = [r for r in normal if not r["exposed"]]
    rejected = [result.outcomes[r["index"]] for r in burst if r["code"] == "RESOURCE_EXHAUSTED"]
    reject_s = sorted(o.ended - o.started for o in rejected)
    statuses: dict[str, int] = {}
    for r in rows:
        key = r["code"] or f"OK ({r['finish_reason']})"
        statuses[key] = statuses.get(key, 0) + 1
    kills = {kind: [f.detect_s for f in result.faults if f.kind == kind and f.injected_at is not None]
             for kind in ("kill_prefill", "kill_decode")}
    hangs = [f.detect_s for f in result.faults if f.kind == "hang_decode" and f.injected_at is not None]
    figures = {
        "requests": len(requests), "sent": len(rows), "unsent": unsent,
        "by_category": {c: count(rows, category=c) for c in ("normal", "burst", "cancel", "deadline")},
        "exact": count(rows, verdict="exact"), "clear": count(rows, verdict="clear"),
        "unclear": count(rows, verdict="unclear"), "corrupted": count(rows, verdict="corrupted"),
        "hung": count(rows, verdict="hung"),
        "hung_open_at_end": sum(1 for o in result.outcomes.values() if o.ended is None),
        "fault_exposed": sum(1 for r in normal if r["exposed"]), "fault_hit": len(hit),
        "fault_hit_server": count(hit, category="normal"), "fault_hit_burst": count(hit, category="burst"),
        "fault_hit_moved": count(hit, moved=True),
        "fault_hit_exact": count(hit, verdict="exact"), "fault_hit_clear": count(hit, verdict="clear"),
        "fault_hit_unclear": count(hit, verdict="unclear"), "fault_hit_corrupted": count(hit, verdict="corrupted"),
        "fault_hit_hung": count(hit, verdict="hung"),
        "fault_hit_exact_rate": round(count(hit, verdict="exact") / len(hit), 4) if hit else None,
        "undisturbed": len(undisturbed), "undisturbed_exact": count(undisturbed, verdict="exact"),
        "burst_sent": len(burst), "burst_sent_by_burst": sum(1 for r in burst if result.outcomes[r["index"]].burst),
        "burst_exact": count(burst, verdict="exact"), "burst_resource_exhausted": len(rejected),
        "burst_other": len(burst) - count(burst, verdict="exact") - len(rejected),
        "burst_reject_p50_s": round(statistics.median(reject_s), 4) if reject_s else None,
        "burst_reject_max_s": round(reject_s[-1], 4) if reject_s else None,
        "cancel_sent": len(cancel), "cancel_cancelled": count(cancel, code="CANCELLED", verdict="clear"),
        "cancel_completed_exact": count(cancel, verdict="exact"),
        "cancel_other_clear": count(cancel, verdict="clear") - count(cancel, code="CANCELLED", verdict="clear"),
        "cancel_other": len(cancel) - count(cancel, verdict="clear") - count(cancel, verdict="exact"),
        "deadline_sent": len(deadline),
        "deadline_exceeded": count(deadline, code="DEADLINE_EXCEEDED", verdict="clear"),
        "deadline_completed_exact": count(deadline, verdict="exact"),
        "deadline_other_clear": count(deadline, verdict="clear") - count(deadline, code="DEADLINE_EXCEEDED",
                                                                         verdict="clear"),
        "deadline_other": len(deadline) - count(deadline, verdict="clear") - count(deadline, verdict="exact"),
        "statuses": dict(sorted(statuses.items())),
        "leaked_blocks": sum(result.blocks_used.values()), "blocks_used_after": result.blocks_used,
        "actors_missing_from_stats": result.missing_actors,
        "router_accounting_left": {k: v for k, v in result.router_accounting.items() if any(v.values())},
        "detect_kill_prefill_s": _rounded(kills["kill_prefill"]),
        "detect_kill_decode_s": _rounded(kills["kill_decode"]),
        "detect_hang_decode_s": _rounded(hangs),
        "drills_fired": sum(1 for f in result.faults if f.injected_at is not None),
        "drills_skipped": [f"{f.kind}: {f.skipped}" for f in result.faults if f.skipped],
        "served_after": result.served_after,
        "run_s": round(result.finished - result.started, 1),
        "router_retries_and_migrations": len(result.router_events),
        "notes": result.notes,
    }
    faults = [_fault_row(f, rows, i, result.started, result.outcomes) for i, f in enumerate(result.faults)]
    events = [[round(t - result.started, 3), rid, message[:300]] for t, rid, message in result.router_events]
    return {"figures": figures, "faults": faults, "records": rows, "router_events": events}


def _rounded(values: list[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 3) for v in values]


def _fault_row(f: FaultRecord, rows: list[dict], i: int, t0: float, outcomes: dict) -> dict:
    exposed = [r for r in rows if i in r["exposed"]]
    hit = [r for r in rows if r["cause"] == i]
    if f.kind == "burst":           # the requests sent while it was on; the admitted ones were hit
        exposed = [r for r in rows if r["category"] == "burst" and f.injected_at is not None
                   and f.injected_at <= outcomes[r["index"]].started <= (f.window_end or float("inf"))]
        hit = [r for r in exposed if r["hit"]]
    return dict(kind=f.kind, victim=f.victim, condition=f.condition, due_at_request=f.due_at_request,
                fired=f.injected_at is not None, skipped=f.skipped, exposed=len(exposed), hit=len(hit),
                shed=sum(1 for r in exposed if r["code"] == "RESOURCE_EXHAUSTED"),
                exact=sum(1 for r in hit if r["verdict"] == "exact"),
                clear=sum(1 for r in hit if r["verdict"] == "clear"),
                other=sum(1 for r in hit if r["verdict"] not in ("exact", "clear")),
                injected_at_s=None if f.injected_at is None else round(f.injected_at - t0, 3),
                detected_by=f.detected_by, detect_s=None if f.detect_s is None else round(f.detect_s, 3),
                recover_s=None if f.recover_s is None else round(f.recover_s, 3))


def contract(figures: dict) -> list[tuple[str, bool, str]]:
    """The chaos run's targets: (name, met, the figure)."""
    fg = figures
    rate = fg["fault_hit_exact_rate"]
    rest = fg["fault_hit"] - fg["fault_hit_exact"]
    kills = [d for d in fg["detect_kill_prefill_s"] + fg["detect_kill_decode_s"]]
    return [
        ("0 hung", fg["hung"] == 0, f"{fg['hung']} hung ({fg['hung_open_at_end']} open at the end)"),
        ("0 leaked blocks", fg["leaked_blocks"] == 0 and not fg["actors_missing_from_stats"],
         f"{fg['leaked_blocks']} blocks used after the run; missing from GetStats: "
         f"{fg['actors_missing_from_stats'] or 'none'}"),
        ("0 corrupted", fg["corrupted"] == 0, f"{fg['corrupted']} corrupted"),
        (f">= {EXACT_TARGET:.0%} of fault-hit requests exact, the rest a clear status",
         fg["fault_hit"] > 0 and rate is not None and rate >= EXACT_TARGET and fg["fault_hit_clear"] == rest,
         f"{fg['fault_hit_exact']}/{fg['fault_hit']} exact ({rate if rate is None else f'{rate:.1%}'}), "
         f"{fg['fault_hit_clear']} clear, {fg['fault_hit_unclear']} unclear, "
         f"{fg['fault_hit_corrupted']} corrupted, {fg['fault_hit_hung']} hung"),
        ("client cancels and deadlines: exact or a clear status", fg["cancel_other"] == 0 and fg["deadline_other"] == 0,
         f"cancel: {fg['cancel_other']} other; deadline: {fg['deadline_other']} other"),
        (f"dead peer detected <= {DETECT_TARGET_S:.0f} s", bool(kills) and all(
            d is not None and d <= DETECT_TARGET_S for d in kills),
         f"prefill kills {fg['detect_kill_prefill_s']} s, decode kills {fg['detect_kill_decode_s']} s"),
        ("router reservations back to 0", not fg["router_accounting_left"], str(fg["router_accounting_left"] or "0")),
        ("every drill fired", not fg["drills_skipped"], "; ".join(fg["drills_skipped"]) or f"{fg['drills_fired']}"),
        ("the bursts went beyond admission", fg["burst_resource_exhausted"] > 0 or not fg["burst_sent"],
         f"{fg['burst_resource_exhausted']} of {fg['burst_sent']} shed with RESOURCE_EXHAUSTED"),
        ("served after the run", fg["served_after"], str(fg["served_after"])),
    ]


def render(summary: dict) -> str:
    """The printed report: the fault table, the request table, the contract."""
    fg = summary["figures"]
    lines = ["", "faults", _table(["#", "fault", "victim", "fired", "exposed", "shed", "hit", "exact", "clear",
                                   "other", "detect s", "whole again s"],
                                  [[str(i), f["kind"], f["victim"], "yes" if f["fired"] else f"no: {f['skipped']}",
                                    str(f["exposed"]), str(f["shed"]), str(f["hit"]), str(f["exact"]), str(f["clear"]),
                                    str(f["other"]), _num(f["detect_s"]), _num(f["recover_s"])]
                                   for i, f in enumerate(summary["faults"])])]
    rate = fg["fault_hit_exact_rate"]
    table = [
        ("requests", f"{fg['requests']} ({', '.join(f'{k} {v}' for k, v in fg['by_category'].items())})"),
        ("hit by a fault", f"{fg['fault_hit']}: {fg['fault_hit_server']} of {fg['fault_exposed']} in flight during "
                           f"a server-side fault ({fg['fault_hit_moved']} retried or migrated by the router), "
                           f"{fg['fault_hit_burst']} admitted during a burst"),
        ("  completed exactly", f"{fg['fault_hit_exact']} ({'-' if rate is None else f'{rate:.1%}'})"),
        ("  ended with a clear status", str(fg["fault_hit_clear"])),
        ("  unclear / corrupted / hung", f"{fg['fault_hit_unclear']} / {fg['fault_hit_corrupted']} / "
                                         f"{fg['fault_hit_hung']}"),
        ("undisturbed (control)", f"{fg['undisturbed_exact']}/{fg['undisturbed']} exact"),
        ("burst", f"{fg['burst_sent']} sent ({fg['burst_sent_by_burst']} by the burst, the rest by the steady "
                  f"clients meanwhile): {fg['burst_exact']} exact, {fg['burst_resource_exhausted']} "
                  f"RESOURCE_EXHAUSTED (p50 {_num(fg['burst_reject_p50_s'])} s, "
                  f"max {_num(fg['burst_reject_max_s'])} s), {fg['burst_other']} other"),
        ("client cancels", f"{fg['cancel_sent']}: {fg['cancel_cancelled']} CANCELLED, "
                           f"{fg['cancel_completed_exact']} finished first (exact), {fg['cancel_other_clear']} "
                           f"another clear status, {fg['cancel_other']} other"),
        ("client deadlines", f"{fg['deadline_sent']}: {fg['deadline_exceeded']} DEADLINE_EXCEEDED, "
                             f"{fg['deadline_completed_exact']} finished first (exact), {fg['deadline_other_clear']} "
                             f"another clear status, {fg['deadline_other']} other"),
        ("all requests", f"{fg['exact']} exact, {fg['clear']} clear status, {fg['unclear']} unclear"),
        ("statuses", ", ".join(f"{k} {v}" for k, v in fg["statuses"].items())),
        ("hung", f"{fg['hung']} ({fg['hung_open_at_end']} open at the end)"),
        ("corrupted", str(fg["corrupted"])),
        ("leaked KV blocks", f"{fg['leaked_blocks']} ("
                             f"{', '.join(f'{k} {v}' for k, v in fg['blocks_used_after'].items())})"),
        ("dead peer detected (s)", f"prefill kills {fg['detect_kill_prefill_s']}, decode kills "
                                   f"{fg['detect_kill_decode_s']}; silent decode (hang) {fg['detect_hang_decode_s']}"),
        ("run", f"{fg['run_s']} s, {fg['router_retries_and_migrations']} router retries/migrations"),
    ]
    lines += ["", "requests", _table(["figure", "value"], [list(row) for row in table])]
    lines += ["", "contract"]
    lines += [f"  [{'met' if ok else 'MISSED'}] {name}: {figure}" for name, ok, figure in contract(fg)]
    lines += [f"  note: {note}" for note in fg["notes"]]
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)])


def write_json(path: str, settings: dict, summary: dict) -> None:
    checks = [dict(name=n, met=ok, figure=f) for n, ok, f in contract(summary["figures"])]
    with open(path, "w") as f:
        json.dump({"settings": settings, **summary, "contract": checks}, f, indent=1)
