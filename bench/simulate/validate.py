"""Simulated against measured, on this machine: the table in docs/benchmarks/simulate.md.

    python -m bench.simulate.validate --model small --scale 0.25 --workloads chat,rag,mixed \\
        --json docs/results/simulate-validation.json

For each workload: the simulator (with this machine's measured profile, `pdserve profile --local`,
made first when the config has none) finds the disaggregated variant's capacity and picks three rates
(0.4, 0.7 and 1.0 of it); at each rate `pdserve bench serve --embedded --compare colocated,
disaggregated,auto` runs the real cluster and `pdserve simulate` the same workload, seed and
arrivals. Printed side by side: TTFT and TPOT p50/p90 of every variant and their ratio, and per
variant the highest rate held at >= 90% SLO attainment over the three rates, and which variant is best.
Role flips are off on both sides. `--repeats N` measures each point N times (this host's own figures
move between runs of the same command): the tables take the median, and count the simulated figures
that fall inside the N runs' range. `--measured JSON` reuses an earlier run's rates and measured
figures and simulates again, e.g. after `python -m bench.serving.plan_check --calibrate` stored the
serving path's time factors in the profile (the measured model applies them). `--shared-host` simulates
the actors on one host as the measured side runs them (`pdserve simulate --shared-host`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

from bench.serving.arg_types import positive_int
from bench.serving.slo_scale import max_rate_rps
from bench.serving.timeline_view import ROWS
from bench.simulate import cli

VARIANTS = ("colocated", "disaggregated", "auto")
FIGURES = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")
STAGES = tuple(f"timeline_{name}_mean" for name, _, _ in ROWS)   # the mean TTFT timeline, stage by stage
KEPT = (*FIGURES, "slo_attainment", "goodput_rps", *STAGES)
FRACTIONS = (0.4, 0.7, 1.0)


def sim_args(args, workload: str, rate: float = math.inf) -> argparse.Namespace:
    flags = ["--workload", workload, "--num-requests", str(args.num_requests), "--scale", str(args.scale),
             "--seed", str(args.seed), "--rate", str(rate), "--slo-ttft-ms", str(args.slo_ttft_ms),
             "--slo-tpot-ms", str(args.slo_tpot_ms), "--set", f"model.name={args.model}",
             "--set", "routing.role_flips=off"]
    if args.profile:
        flags += ["--profile", args.profile]
    if args.shared_host:
        flags.append("--shared-host")
    return cli.with_defaults(cli.build_parser().parse_args(flags))


def measured(args, workload: str, rate: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, "-m", "bench.serving", "--embedded", "--model", args.model, "--workload", workload,
           "--num-requests", str(args.num_requests), "--scale", str(args.scale), "--seed", str(args.seed),
           "--request-rate", str(rate), "--compare", ",".join(VARIANTS), "--set", "routing.role_flips=off",
           "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms), "--no-progress",
           "--json", path]
    print(" ".join(cmd[1:]), file=sys.stderr)
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    try:
        with open(path) as f:
            runs = json.load(f)["runs"]
    finally:
        os.unlink(path)
    return {v: {k: runs[v].get(k) for k in KEPT} for v in VARIANTS}


def measured_repeats(args, workload: str, rate: float) -> dict:
    """`measured` `args.repeats` times: each figure's median, and with several runs each figure's
    range over them (``range``: {variant: {figure: [min, max]}}): how far the host itself moves."""
    runs = [measured(args, workload, rate) for _ in range(args.repeats)]
    if len(runs) == 1:
        return runs[0]

    def values(v: str, k: str) -> list[float]:
        return [run[v][k] for run in runs if run[v].get(k) is not None and not math.isnan(run[v][k])]

    out = {v: {k: statistics.median(values(v, k)) if values(v, k) else None for k in runs[0][v]} for v in VARIANTS}
    out["range"] = {v: {k: [min(values(v, k)), max(values(v, k))] if values(v, k) else [None, None] for k in FIGURES}
                    for v in VARIANTS}
    out["runs"] = runs
    return out


def simulated(args, workload: str, rate: float) -> dict:
    a = sim_args(args, workload, rate)
    specs = cli.workload(a)
    out = {}
    for v in VARIANTS:
        s = cli.run_one(a, v, specs, rate).summary
        out[v] = {k: s.get(k) for k in KEPT}
    return out


def ensure_profile(args) -> None:
    if args.profile:
        return
    from bench.serving.cluster import variant_values
    from deploy.config import load_config
    from deploy.plan_cli import obtain_profile
    cfg = load_config(None, variant_values(args.model, None, ["routing.role_flips=off"], "disaggregated"))
    _, args.profile = obtain_profile(cfg, None, local=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simulate.validate", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--profile", help="measured profile (default: the config's, made first if missing)")
    p.add_argument("--workloads", default="chat,rag,mixed")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--rates", help="workload=r1:r2:r3,... (default: 0.4/0.7/1.0 of the simulated capacity)")
    p.add_argument("--repeats", type=positive_int, default=1, metavar="N", help="measure each point N times: the "
                   "tables take each figure's median and count the simulated figures inside the N runs' range")
    p.add_argument("--measured", metavar="JSON", help="take the rates and measured figures of an earlier run's "
                   "--json and simulate only (e.g. again with a calibrated profile)")
    p.add_argument("--shared-host", action="store_true", help="simulate every actor on this one host, as the "
                   "measured side runs them (`pdserve simulate --shared-host`: the profile's shared-host calibration)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    ensure_profile(args)
    given = dict(item.split("=") for item in args.rates.split(",")) if args.rates else {}
    earlier = {}
    if args.measured:
        with open(args.measured) as f:
            earlier = json.load(f)["workloads"]
    from deploy.profiler import load_profile
    result = {"profile": args.profile, "calibration": load_profile(args.profile).get("calibration", {}),
              "shared_host": args.shared_host, "model": args.model, "scale": args.scale,
              "measured_from": args.measured, "workloads": {}}
    for workload in args.workloads.split(","):
        if workload in earlier:
            rates = earlier[workload]["rates"]
            old = {pt["rate"]: pt["measured"] for pt in earlier[workload]["points"]}
        elif workload in given:
            rates = [float(r) for r in given[workload].split(":")]
        else:
            a = sim_args(args, workload)
            cap = cli.capacity(a, "disaggregated", cli.workload(a))
            rates = [round(cap * f, 2) for f in FRACTIONS]
        points = [{"rate": r, "measured": old[r] if workload in earlier else measured_repeats(args, workload, r),
                   "simulated": simulated(args, workload, r)} for r in rates]
        held = {side: {v: max_rate_rps([{"x": pt["rate"], "slo_attainment": pt[side][v]["slo_attainment"]}
                                        for pt in points]) for v in VARIANTS} for side in ("measured", "simulated")}
        result["workloads"][workload] = {"rates": rates, "points": points, "max_rate": held}
        print_workload(workload, points, held)
        print_stages(points)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def print_stages(points: list[dict], variant: str = "disaggregated") -> None:
    """Where each side's TTFT goes: the mean timeline of `variant`, stage by stage, measured beside simulated
    at each rate (stages under 0.5 ms on both sides left out; runs measured before stages were kept: none)."""
    rows = []
    for name, (stage, where, _) in zip(STAGES, ROWS):
        cells = [(pt["measured"][variant].get(name), pt["simulated"][variant].get(name)) for pt in points]
        if any(m is not None and s is not None and max(m, s) >= 5e-4 for m, s in cells):
            rows.append(f"| {stage[:-2].replace('_', ' ')} ({where}) | " + " | ".join(
                f"{_ms(m)} / {_ms(s)}" for m, s in cells) + " |")
    if not rows:
        return
    print(f"\n{variant}: mean TTFT timeline per stage, measured / simulated (ms)\n")
    print("| stage | " + " | ".join(f"{pt['rate']:g} req/s" for pt in points) + " |")
    print("|---|" + "---|" * len(points))
    print("\n".join(rows))


def _ms(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "–"
    return f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def print_workload(workload: str, points: list[dict], held: dict) -> None:
    print(f"\n### {workload}\n")
    print("| rate (req/s) | variant | TTFT p50 meas / sim (ms) | TTFT p90 | TPOT p50 | TPOT p90 "
          "| SLO att. meas / sim |")
    print("|---|---|---|---|---|---|---|")
    for pt in points:
        for v in VARIANTS:
            m, s = pt["measured"][v], pt["simulated"][v]
            cells = [f"{_ms(m[k])} / {_ms(s[k])} ({_ratio(s[k], m[k])})" for k in FIGURES]
            print(f"| {pt['rate']:g} | {v} | " + " | ".join(cells) +
                  f" | {m['slo_attainment'] * 100:.0f}% / {s['slo_attainment'] * 100:.0f}% |")
    spread = [(pt["measured"]["range"][v][k], pt["simulated"][v][k]) for pt in points if "range" in pt["measured"]
              for v in VARIANTS for k in FIGURES]
    if spread:
        inside = sum(lo <= s <= hi for (lo, hi), s in spread if s is not None and lo is not None)
        print(f"\nsimulated figures inside the range of the repeated measured runs: {inside} of {len(spread)}")
    best = {side: max(VARIANTS, key=lambda v: held[side][v]["max_rate_rps"]) for side in held}
    rows = ", ".join(f"{v} {held['measured'][v]['max_rate_rps']:.2f} / {held['simulated'][v]['max_rate_rps']:.2f}"
                     for v in VARIANTS)
    print(f"\nmax rate at >= 90% attainment (req/s, measured / simulated): {rows}; best: "
          f"{best['measured']} / {best['simulated']}")


def _ratio(sim: float | None, meas: float | None) -> str:
    if not sim or not meas:
        return "–"
    return f"{sim / meas:.2f}×"


if __name__ == "__main__":
    sys.exit(main())
