"""`pdserve simulate`: the real control plane on a simulated clock — should I disaggregate, with what split?

    pdserve simulate --workload mixed --rate 2 --compare colocated,disaggregated,auto
    pdserve simulate --hardware H100-SXM --model llama-3-8b --workload rag --sweep rate
    pdserve simulate --hardware A100-80GB --model opt-13b --sweep split --devices 8 --workload chat
    pdserve simulate --profile ~/.cache/pdserve/profiles/tiny-….json --workload chat --rate 1 --json out.json

Time comes from a measured profile of this machine (`--profile`, default: the config's cached one,
written by `pdserve profile`) or from a roofline of `--hardware` (a shipped name or a YAML file) and the
`--model` (a model directory or a shipped shape). The router, the workers, their schedulers and block
managers are pdserve's own (bench/simulate/sim_cluster.py); the report is `pdserve bench serve`'s.

    --sweep rate    each variant at rates around the first one's capacity: SLO attainment per rate and
                    the highest rate held at >= 90% (DistServe's goodput)
    --sweep split   every (prefill, decode) split of --devices actors, and colocated on all of them:
                    max rate at >= 90% attainment per device, the best split beside `pdserve plan`'s
    --sweep ratio   disaggregated vs colocated as the prompt:output length ratio moves (--sweep-values
                    "P:O,P:O,…"): where disaggregation starts to pay
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from bench.serving.runs import autoscale_settings
from bench.serving.slo_scale import max_rate_rps, rates_around
from bench.serving.sweep import print_points
from bench.serving.tables import lengths_line, table
from bench.serving.workloads import MULTI_TURN, describe, make_conversations, make_workload
from bench.simulate.run import SimRun, simulate
from bench.simulate.sim_control import ACTOR_START_S
from bench.simulate.step_time import StepTimeModel
from deploy.config import ConfigError
from engine.model.config import ModelConfig

VARIANT_MODES = {"disaggregated": ("disaggregated", True), "disaggregated-no-reuse": ("disaggregated", True),
                 "colocated": ("colocated", False), "colocated-chunked": ("colocated", True),
                 "auto": ("disaggregated", True)}
FIGURES = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "goodput_rps",
           "slo_attainment", "request_throughput_rps")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve simulate", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    c = p.add_argument_group("cluster")
    c.add_argument("--config", help="pools.yaml (default: the embedded default)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    c.add_argument("--mode", choices=list(VARIANT_MODES), default="disaggregated")
    c.add_argument("--compare", help="variants side by side, e.g. colocated,disaggregated,auto")
    c.add_argument("--devices", type=int, help="--sweep split: actors (devices) to split between the pools")
    c.add_argument("--autoscale-interval", type=float, default=2.0, metavar="S",
                   help="autoscaler period (pools with count auto, routing.role_flips auto); its window is 10 periods")
    c.add_argument("--actor-start-s", type=float, default=ACTOR_START_S, metavar="S",
                   help="simulated seconds a new actor takes to come up (autoscaler growth)")
    t = p.add_argument_group("time model")
    t.add_argument("--profile", help="a `pdserve profile` file (default: the config's cached profile)")
    t.add_argument("--hardware", help="roofline of a GPU: A100-80GB, H100-SXM, H200, L40S or a YAML file")
    t.add_argument("--model", help="with --hardware: the simulated model (a directory with config.json, or "
                   "llama-3-8b, llama-3-70b, llama-2-7b, llama-2-13b, opt-13b, opt-66b; default: the config's)")
    t.add_argument("--dtype", default="bf16", help="with --hardware: weights' and KV's dtype (bf16, fp16, fp8)")
    t.add_argument("--tensor-parallel", type=int, default=1, help="with --hardware: GPUs per actor")
    t.add_argument("--intra-node", action="store_true", help="with --hardware: KV moves over the node's "
                   "GPU link (NVLink) instead of the network between nodes")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="mixed", help="chat | rag | mixed | shared-prefix | multi-turn | phases "
                   "(chat → rag → chat) | FILE.jsonl")
    w.add_argument("--num-requests", type=int, default=200, help="requests (multi-turn: conversations)")
    w.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--scale", type=float, default=1.0, help="multiply every prompt and output length")
    w.add_argument("--prompt-len", type=int, help="fix every prompt's length")
    w.add_argument("--output-len", type=int, help="fix every output's length")
    w.add_argument("--rate", type=float, default=math.inf, help="mean arrivals per second (inf: all at once)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--timeout", type=float, default=600.0, help="per-request deadline (simulated s)")
    s = p.add_argument_group("SLOs, sweeps and output")
    s.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    s.add_argument("--slo-tpot-ms", type=float, default=100.0)
    s.add_argument("--sweep", choices=["rate", "split", "ratio"])
    s.add_argument("--sweep-values", help="rates (comma-separated), or P:O length pairs for --sweep ratio")
    s.add_argument("--json", metavar="FILE", help="write every figure here")
    s.add_argument("--plot", metavar="DIR", help="write the sweep's plot here")
    s.add_argument("--progress", action="store_true", help="a progress line per run")
    return p


# ---------------------------------------------------------------- inputs

def variant_config(args: argparse.Namespace, variant: str, extra: list[str] = ()):
    from bench.serving.cluster import variant_values
    from deploy.config import load_config
    return load_config(args.config, variant_values(None, None, [*args.set, *extra], variant))


def time_model(args: argparse.Namespace, cfg) -> tuple[StepTimeModel, ModelConfig]:
    """The step-time model the flags ask for, and the simulated model's shape."""
    if args.hardware:
        from bench.simulate.hardware import Hardware
        from bench.simulate.models import model_config
        from bench.simulate.roofline import RooflineModel
        shape = model_config(args.model or cfg.model.name)
        model = RooflineModel(Hardware.load(args.hardware), shape, dtype=args.dtype,
                              tensor_parallel=args.tensor_parallel, inter_node=not args.intra_node,
                              model_name=args.model or cfg.model.name)
        return model, shape
    from bench.simulate.measured import MeasuredModel
    from deploy.profiler import default_profile_path
    from engine.model.presets import resolve_model
    path = args.profile or default_profile_path(cfg)
    if not os.path.isfile(path):
        raise ValueError(f"no measured profile at {path}: run `pdserve profile --local` for this config, pass "
                         "--profile FILE, or simulate a GPU with --hardware")
    return MeasuredModel.from_file(path), ModelConfig.from_dir(resolve_model(cfg.model.name))


def workload(args: argparse.Namespace, prompt_len: int | None = None, output_len: int | None = None) -> list:
    if args.workload == MULTI_TURN:
        return make_conversations(args.num_requests, args.num_turns, args.seed, args.scale,
                                  output_len or args.output_len)
    return make_workload(args.workload, args.num_requests, args.seed, args.scale,
                         prompt_len or args.prompt_len, output_len or args.output_len)


def lengths_of(specs: list) -> dict:
    if specs and hasattr(specs[0], "output_lens"):
        return {"conversations": len(specs), "turns": sum(c.num_turns for c in specs)}
    return describe(specs)


# ---------------------------------------------------------------- runs

def run_one(args, variant: str, specs: list, rate: float, counts: dict | None = None, label: str = "",
            extra: list[str] = ()) -> SimRun:
    cfg = variant_config(args, variant, extra)
    model, shape = time_model(args, cfg)
    mode, chunked = VARIANT_MODES[variant]
    run = simulate(cfg, model, shape, specs, rate=rate, mode=mode, chunked=chunked, seed=args.seed,
                   burstiness=args.burstiness, slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=args.slo_tpot_ms / 1e3,
                   counts=counts, label=label or variant, progress=args.progress, timeout_s=args.timeout,
                   autoscale=autoscale_settings(args), actor_start_s=args.actor_start_s)
    s = run.summary
    print(f"{run.label} @ {rate:g} req/s: TTFT p50 {s['ttft_p50_s'] * 1e3:.1f} ms, TPOT p50 "
          f"{s['tpot_p50_s'] * 1e3:.2f} ms, SLO attainment {s['slo_attainment'] * 100:.0f}% "
          f"({len(run.records)} requests in {run.wall_s:.1f} s wall, {run.requests_per_wall_s:.0f} req/s)"
          + (f"; {len(run.flips)} role flips" if run.flips else ""), file=sys.stderr)
    return run


def capacity(args, variant: str, specs: list, counts: dict | None = None) -> float:
    """Requests/s the variant completes with every request sent at once."""
    run = run_one(args, variant, specs, math.inf, counts, label=f"{variant} capacity")
    return run.summary["completed"] / run.duration_s if run.duration_s > 0 else 0.0


def rate_points(args, variant: str, specs: list, rates: list[float], counts: dict | None = None,
                label: str = "") -> list[dict]:
    points = []
    for rate in rates:
        s = run_one(args, variant, specs, rate, counts, label=label or variant).summary
        points.append({"x": rate, **{k: s[k] for k in FIGURES}})
    return points


def sweep_rates(args, variants: list[str], specs: list) -> dict:
    values = [float(v) for v in (args.sweep_values or "").split(",") if v.strip()]
    if not values:
        values = rates_around(capacity(args, variants[0], specs))
    points = {v: rate_points(args, v, specs, values) for v in variants}
    print_points("rate", points)
    held = {v: max_rate_rps(rows) for v, rows in points.items()}
    for v, m in held.items():
        print(f"{v}: max rate at >= 90% SLO attainment {m['max_rate_rps']:.3g} req/s"
              f"{'' if m['bounded'] else ' (every rate held it: a lower bound)'}")
    return {"sweep": "rate", "values": values, "points": points, "max_rate_rps": held}


def sweep_split(args, specs: list) -> dict:
    """Every split of --devices actors (and colocated on all of them) at common rates; the best beside the plan."""
    n = args.devices or 4
    if n < 2:
        raise ValueError("--devices must be at least 2 for --sweep split")
    splits = {f"{p}P{n - p}D": {"prefill": p, "decode": n - p} for p in range(1, n)}
    colocated = {"prefill": 1, "decode": n - 1}                   # n colocated engines
    values = [float(v) for v in (args.sweep_values or "").split(",") if v.strip()]
    if not values:
        values = rates_around(capacity(args, "colocated-chunked", specs, colocated) * 1.5)
    points = {"colocated": rate_points(args, "colocated-chunked", specs, values, colocated, f"colocated x{n}")}
    for label, counts in splits.items():
        points[label] = rate_points(args, "disaggregated", specs, values, counts, label)
    held = {k: max_rate_rps(v) for k, v in points.items()}
    print_points("rate", points)
    print(f"\nmax rate at >= 90% SLO attainment over {n} devices")
    for k, m in held.items():
        print(f"  {k:<12} {m['max_rate_rps']:>8.3g} req/s  {m['max_rate_rps'] / n:>8.3g} req/s per device"
              f"{'' if m['bounded'] else '  (lower bound)'}")
    best = max(held, key=lambda k: held[k]["max_rate_rps"])
    plan = planned_split(args, specs, held[best]["max_rate_rps"], n)
    print(f"best: {best} ({held[best]['max_rate_rps'] / n:.3g} req/s per device); pdserve plan at that rate: {plan}")
    return {"sweep": "split", "devices": n, "values": values, "points": points, "max_rate_rps": held, "best": best,
            "plan": plan}


def planned_split(args, specs: list, rate: float, devices: int) -> str:
    """What `pdserve plan` recommends for this workload at `rate`, from the same time model."""
    from bench.simulate.plan_profile import plan_with_model
    cfg = variant_config(args, "disaggregated")
    model, shape = time_model(args, cfg)
    flat = [s for s in specs if hasattr(s, "output_len")]
    if not flat or not rate or math.isinf(rate):
        return "–"
    try:
        p = plan_with_model(cfg, model, shape, flat, rate, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    except ValueError as e:
        return f"no plan ({e})"
    return f"{p.n_prefill}P{p.n_decode}D (prefill:decode {p.ratio:.2f}; {p.n_prefill + p.n_decode} devices" + \
        (f", more than the {devices} given)" if p.n_prefill + p.n_decode > devices else ")")


DEFAULT_RATIOS = "200:200,1000:200,2000:200,5000:500,10000:1000"


def sweep_ratio(args) -> dict:
    """Disaggregated vs colocated (chunked) at each prompt:output ratio, at equal actors. Each variant's
    rates reach 1.5x the larger of the two capacities; a figure every rate held is a lower bound (≥)."""
    cfg = variant_config(args, "colocated")
    _, shape = time_model(args, cfg)
    context = min(cfg.model.max_model_len or shape.max_position_embeddings, shape.max_position_embeddings)
    pairs = []
    for value in (args.sweep_values or DEFAULT_RATIOS).split(","):
        try:
            prompt_len, output_len = (int(x) for x in value.split(":"))
        except ValueError:
            raise ValueError(f"--sweep-values: {value!r} is not PROMPT:OUTPUT (e.g. 2000:200)") from None
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"--sweep-values: {value!r}: both lengths must be at least 1")
        if prompt_len + output_len > context:
            if args.sweep_values:
                raise ValueError(f"--sweep-values: {value} needs {prompt_len + output_len} tokens, more than the "
                                 f"model's context of {context}")
            print(f"skipping {value}: more than the model's context of {context} tokens", file=sys.stderr)
            continue
        pairs.append((prompt_len, output_len))
    rows = []
    for prompt_len, output_len in pairs:
        specs = make_workload("chat", args.num_requests, args.seed, 1.0, prompt_len, output_len)
        caps = [capacity(args, v, specs) for v in ("colocated-chunked", "disaggregated")]
        values = rates_around(max(caps) * 1.5)
        held = {v: max_rate_rps(rate_points(args, v, specs, values)) for v in ("colocated-chunked", "disaggregated")}
        rate = {v: m["max_rate_rps"] for v, m in held.items()}
        gain = rate["disaggregated"] / rate["colocated-chunked"] if rate["colocated-chunked"] else math.inf
        rows.append({"prompt_len": prompt_len, "output_len": output_len, **rate, "gain": gain,
                     "bounded": {v: m["bounded"] for v, m in held.items()}})
    print(f"\n{'prompt:output':>14} {'colocated':>11} {'disagg.':>11} {'disagg./coloc.':>15}   (req/s at >= 90% SLO; "
          "≥: every rate held it)")
    for r in rows:
        def cell(v: str) -> str:
            return ("" if r["bounded"][v] else "≥") + f"{r[v]:.3g}"
        print(f"{r['prompt_len']:>8}:{r['output_len']:<5} {cell('colocated-chunked'):>11} {cell('disaggregated'):>11} "
              f"{r['gain']:>14.2f}×")
    return {"sweep": "ratio", "rows": rows}


def plot(result: dict, out_dir: str, title: str) -> str | None:
    if result.get("sweep") not in ("rate", "split"):
        return None
    from bench.serving.plots import plot_slo_attainment
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"simulate_{result['sweep']}.png")
    return plot_slo_attainment(result["points"], path, title)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = variant_config(args, args.mode)
        model, _ = time_model(args, cfg)
        variants = [v.strip() for v in (args.compare or args.mode).split(",") if v.strip()]
        unknown = [v for v in variants if v not in VARIANT_MODES]
        if unknown:
            raise ValueError(f"--compare: unknown variant {unknown[0]!r}; use {', '.join(VARIANT_MODES)}")
        print(f"time model: {model.name}", file=sys.stderr)
        if args.sweep == "ratio":
            result = sweep_ratio(args)
        else:
            specs = workload(args)
            if args.sweep == "split":
                result = sweep_split(args, specs)
            elif args.sweep == "rate":
                result = sweep_rates(args, variants, specs)
            else:
                runs = {v: run_one(args, v, specs, args.rate) for v in variants}
                summaries = {v: r.summary for v, r in runs.items()}
                print(table(summaries, ratio_of="disaggregated" if "disaggregated" in summaries else None))
                result = {"runs": summaries, "actors": {v: r.actors for v, r in runs.items()},
                          "wall_s": {v: r.wall_s for v, r in runs.items()},
                          "roles_over_time": {v: r.roles for v, r in runs.items()},
                          "flips": {v: r.flips for v, r in runs.items()}}
            lengths = lengths_of(specs)
            if "input_len" in lengths:
                print(lengths_line(lengths))
            result["lengths"] = lengths
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result.update(time_model=model.name, workload=args.workload, rate=args.rate, seed=args.seed,
                  slo={"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms})
    if args.plot:
        path = plot(result, args.plot, f"{args.workload}, {model.name}")
        if path:
            result["plot"] = path
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
