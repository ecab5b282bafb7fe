"""`pdserve simulate`: the real control plane on a simulated clock — should I disaggregate, with what split?

    pdserve simulate --workload chat --scale 0.5 --rate 2 --compare colocated,disaggregated,auto
    pdserve simulate --hardware H100-SXM --model llama-3-8b --workload rag --sweep rate
    pdserve simulate --hardware A100-80GB --model opt-13b --sweep split --devices 8 --workload chat
    pdserve simulate --hardware H100-SXM --model llama-3-70b --sweep split --devices 8 --tp 1,2,4
    pdserve profile --local --model tiny         # then this host's measured profile of it times:
    pdserve simulate --set model.name=tiny --workload chat --rate 1 --json out.json
    pdserve simulate --hardware H100-SXM --model llama-3-8b --workload chat --rate 8 \\
        --compare colocated-chunked,colocated-spec --spec-acceptance 0.6

Time comes from a measured profile of this machine (`--profile`, default: the config's cached one,
written by `pdserve profile`) or from a roofline of `--hardware` (a shipped name or a YAML file) and the
`--model` (a model directory or a shipped shape). The router, the workers, their schedulers and block
managers are pdserve's own (bench/simulate/sim_cluster.py); the report is `pdserve bench serve`'s.
Each pool's actors run at its `pools.<pool>.tensor_parallel` (`--set`, or `--tensor-parallel N` for all).
With `speculative:` on (the config, `--set speculative.method=ngram`, or a `-spec` variant), decode and
colocated actors speculate as the engine does, their proposals accepted at `--spec-acceptance` (else the
profile's measurement; bench/simulate/sim_spec.py).

    --sweep rate    each variant at rates around the first one's capacity: SLO attainment per rate and
                    the highest rate held at >= 90% (DistServe's goodput)
    --sweep split   every (prefill TP × count, decode TP × count) within --devices GPUs, degrees from --tp
                    (default 1), and colocated at each degree: max rate at >= 90% attainment per device,
                    the best beside the choice of `pdserve plan --devices N --tp …` on the same time model
    --sweep ratio   disaggregated vs colocated as the prompt:output length ratio moves (--sweep-values
                    "P:O,P:O,…"): where disaggregation starts to pay
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from typing import NamedTuple

from bench.serving.arg_types import (float_list, non_negative_float, non_negative_int, output_file, positive_float,
                                      positive_int, request_rate)
from bench.serving.metrics import meets_slo
from bench.serving.runs import autoscale_settings, router_slo
from bench.serving.slo_scale import ATTAINMENT, max_rate_rps, rates_around
from bench.serving.strict_json import write_json
from bench.serving.sweep import print_points
from bench.serving.tables import lengths_line, table
from bench.serving.workloads import MULTI_TURN, describe, is_trace_file, make_conversations, make_workload
from bench.simulate.measured import MeasuredModel
from bench.simulate.parallel import WorkerLost, available_cores, jobs, map_runs
from bench.simulate.plan_profile import search_with_model, usable_degrees
from bench.simulate.roofline import DTYPE_BYTES
from bench.simulate.run import SimRun, simulate
from bench.simulate.sim_cluster import context_of
from bench.simulate.sim_control import ACTOR_START_S
from bench.simulate.sim_spec import describe_speculation, speculation_for
from bench.simulate.step_time import PoolModels, StepTimeModel
from deploy.config import ConfigError
from deploy.launcher import tensor_parallel_degrees
from deploy.plan_cli import ParallelismSearch
from engine.model.config import ModelConfig

VARIANT_MODES = {"disaggregated": ("disaggregated", True), "disaggregated-no-reuse": ("disaggregated", True),
                 "colocated": ("colocated", False), "colocated-chunked": ("colocated", True),
                 "auto": ("disaggregated", True), "disaggregated-spec": ("disaggregated", True),
                 "colocated-spec": ("colocated", True)}
MAX_SPLIT_DEVICES = 1024     # --sweep split at 1024: 523,776 splits at degree 1, about a minute here (--top 1)
MAX_SPAN_S = 86_400.0       # the arrivals of one run may span a simulated day; the control plane's periodic work
#                             (KV event polls every 0.2 s per actor, role samples) costs wall time per simulated second
MAX_REQUESTS = 10_000_000  # requests (or conversations) a run may simulate
MIN_AUTOSCALE_INTERVAL_S = 0.05   # an autoscaler tick below this is no period a cluster runs (and each tick costs)
SWEEP_CHOOSES = {
    "rate": "it runs each variant at rates around the first one's capacity (or --sweep-values)",
    "split": "it runs every split at rates per device around the best capacity (or --sweep-values), disaggregated "
             "and colocated",
    "ratio": "it runs chat-shaped requests of each --sweep-values PROMPT:OUTPUT pair, disaggregated and colocated "
             "(chunked), at rates around their capacities",
}
FIGURES = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "goodput_rps",
           "slo_attainment", "request_throughput_rps")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve simulate", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    c = p.add_argument_group("cluster")
    c.add_argument("--config", help="pools.yaml (default: the embedded default)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    c.add_argument("--mode", choices=list(VARIANT_MODES), help="the variant of a single run or a rate sweep "
                   "(default disaggregated; colocated: no chunked prefill; auto: the router places each prompt)")
    c.add_argument("--compare", help="variants side by side instead of --mode, e.g. colocated,disaggregated,auto")
    c.add_argument("--devices", type=positive_int,
                   help="--sweep split: devices (GPUs) to split between the pools (default 4)")
    c.add_argument("--tp", metavar="D,D,…", help="--sweep split: tensor-parallel degrees to try per "
                   "pool (those the model's heads and the GPU's memory allow)")
    c.add_argument("--top", type=non_negative_int, metavar="K", help="--sweep split: simulate the K "
                   "candidates the planner ranks highest (default 8; 0: all; colocated at each degree always runs)")
    c.add_argument("--autoscale-interval", type=positive_float, default=2.0, metavar="S",
                   help="autoscaler period (pools with count auto, routing.role_flips auto); its window is 10 periods")
    c.add_argument("--actor-start-s", type=non_negative_float, default=ACTOR_START_S, metavar="S",
                   help="simulated seconds a new actor takes to come up (autoscaler growth)")
    t = p.add_argument_group("time model")
    t.add_argument("--profile", help="a `pdserve profile` file (default: the config's cached profile)")
    t.add_argument("--hardware", help="roofline of a GPU: A100-80GB, H100-SXM, H200, L40S or a YAML file")
    t.add_argument("--model", help="with --hardware: the simulated model (a directory with config.json, or "
                   "llama-3-8b, llama-3-70b, llama-2-7b, llama-2-13b, opt-13b, opt-66b; default: the config's)")
    t.add_argument("--dtype", choices=list(DTYPE_BYTES), help="with --hardware: weights' and KV's dtype "
                   "(default bf16)")
    t.add_argument("--tensor-parallel", type=positive_int, metavar="N", help="every pool at N GPUs per actor (sets "
                   "pools.<pool>.tensor_parallel; an error beside --set of either); per pool: --set "
                   "pools.decode.tensor_parallel=N")
    t.add_argument("--intra-node", action="store_true", help="with --hardware: KV moves over the node's "
                   "GPU link (NVLink) instead of the network between nodes")
    t.add_argument("--shared-host", action="store_true", help="every actor on the one host the profile measured "
                   "(as `pdserve bench serve --embedded` runs them): a step overlapping others' is slowed by the "
                   "profile's shared-host calibration (bench.serving.plan_check --phases light,shared --calibrate)")
    t.add_argument("--spec-acceptance", type=float, metavar="A", help="with speculative decoding (speculative."
                   "method, or a -spec variant: ngram): the proposals' acceptance rate, accepted / proposed tokens "
                   "at speculative.num_tokens per step, 0..1 (default: the profile's measurement)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", help="chat | rag | mixed | shared-prefix | multi-turn | phases "
                   "(chat → rag → chat) | FILE.jsonl (default mixed)")
    w.add_argument("--num-requests", type=positive_int, default=200, help="requests (multi-turn: conversations)")
    w.add_argument("--num-turns", type=positive_int, help="multi-turn: turns per conversation (default 4)")
    w.add_argument("--scale", type=positive_float, help="multiply every prompt and output length (default 1)")
    w.add_argument("--prompt-len", type=positive_int, help="fix every prompt's length")
    w.add_argument("--output-len", type=positive_int, help="fix every output's length")
    w.add_argument("--rate", type=request_rate, help="a single run's mean arrivals per second (default inf: all "
                   "at once); a sweep chooses its own (--sweep-values)")
    w.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    w.add_argument("--seed", type=int, default=0, help="the workload's and the arrivals' seed (default 0)")
    w.add_argument("--timeout", type=positive_float, default=600.0, help="per-request deadline (simulated s)")
    s = p.add_argument_group("SLOs, sweeps and output")
    s.add_argument("--slo-ttft-ms", type=positive_float, default=1000.0, help="time to first token SLO (default 1000)")
    s.add_argument("--slo-tpot-ms", type=positive_float, default=100.0, help="time per output token SLO (default 100)")
    s.add_argument("--sweep", choices=["rate", "split", "ratio"], help="runs at many rates, splits or length "
                   "ratios (below)")
    s.add_argument("--sweep-values", help="rates (comma-separated; --sweep split: offered to all "
                   "--devices, in proportion to a candidate on fewer), or P:O length pairs for --sweep ratio")
    s.add_argument("--json", metavar="FILE", type=output_file, help="write every figure here")
    s.add_argument("--plot", metavar="DIR", help="with --sweep rate or split: write the sweep's plot here")
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="each run's progress on stderr (requests done, wall seconds): by default one redrawn line "
                   "where stderr is a terminal and none elsewhere; --progress also writes a line per tenth to a log")
    s.add_argument("--jobs", type=positive_int, default=available_cores(), metavar="N",
                   help="simulations run side by side in worker processes (a sweep's points, --compare's "
                   "variants); default: the cores available")
    return p


# ---------------------------------------------------------------- inputs

def check_flags(args: argparse.Namespace) -> None:
    """ValueError for flags that contradict each other or that the run would ignore."""
    if args.hardware is not None and not args.hardware.strip():
        raise ValueError("--hardware: give a GPU name or a YAML file")
    if args.hardware and args.profile:
        raise ValueError("--profile times a measured host and --hardware a GPU's roofline: use either")
    if not args.hardware:
        given = [flag for flag, value in (("--model", args.model), ("--dtype", args.dtype),
                                          ("--intra-node", args.intra_node)) if value]
        if given:
            raise ValueError(f"{given[0]} applies with --hardware (a roofline); a measured profile times the model "
                             "and dtype it measured (set the config's model.name to profile another)")
    split_only = [flag for flag, value in (("--devices", args.devices), ("--tp", args.tp), ("--top", args.top))
                  if value is not None]
    if split_only and args.sweep != "split":
        raise ValueError(f"{split_only[0]} applies with --sweep split")
    if args.sweep_values and not args.sweep:
        raise ValueError("--sweep-values applies with --sweep rate, split or ratio")
    for flag, value in (("--json", args.json), ("--plot", args.plot)):
        if value is not None and not value.strip():
            raise ValueError(f"{flag}: give a {'file' if flag == '--json' else 'directory'} name")
    workload = args.workload or ""
    if args.num_turns is not None and workload != MULTI_TURN:
        raise ValueError(f"--num-turns applies with --workload {MULTI_TURN}")
    if args.prompt_len is not None and workload == MULTI_TURN:
        raise ValueError(f"--prompt-len does not apply to --workload {MULTI_TURN}: each turn's prompt is the "
                         "conversation so far (--scale and --output-len do)")
    if args.scale is not None and is_trace_file(workload):
        raise ValueError(f"--scale does not apply to a trace (--workload {workload}): its lengths are its own; "
                         "--prompt-len / --output-len replace them")
    if workload == "structured":
        raise ValueError("--workload structured: the simulator does not model grammar-constrained decoding (its "
                         "mask's cost per token); `pdserve bench serve --embedded --workload structured` "
                         "measures it here")
    if args.sweep == "split" and args.tensor_parallel is not None:
        raise ValueError("--tensor-parallel does not apply to --sweep split: it tries each degree of --tp per pool")
    if args.mode is not None and args.compare is not None:
        raise ValueError("--mode runs one variant and --compare several: use either")
    ignored = {"rate": ("--rate",), "split": ("--rate", "--mode", "--compare"),
               "ratio": ("--rate", "--mode", "--compare", "--workload", "--scale", "--prompt-len", "--output-len")}
    for flag in ignored.get(args.sweep, ()):
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise ValueError(f"{flag} does not apply to --sweep {args.sweep}: {SWEEP_CHOOSES[args.sweep]}")
    if args.plot and args.sweep not in ("rate", "split"):
        raise ValueError("--plot applies with --sweep rate or split (the only runs it draws)")
    if args.autoscale_interval < MIN_AUTOSCALE_INTERVAL_S:
        raise ValueError(f"--autoscale-interval {args.autoscale_interval:g}: at least {MIN_AUTOSCALE_INTERVAL_S:g} s")
    if args.num_requests > MAX_REQUESTS:
        raise ValueError(f"--num-requests {args.num_requests:,}: at most {MAX_REQUESTS:,} (a simulation runs a few "
                         "hundred requests per second of wall time)")
    span = args.num_requests / (args.rate or math.inf)
    if not args.sweep and span > MAX_SPAN_S:
        raise ValueError(f"--rate {args.rate:g} with --num-requests {args.num_requests} spreads the arrivals over "
                         f"about {span:.3g} simulated seconds (at most {MAX_SPAN_S:,.0f}: the control plane's "
                         "periodic work costs wall time for every simulated second): raise --rate or lower "
                         "--num-requests")
    check_writable(args)


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the defaults of the flags `check_flags` needed to see unset: what each run uses (a ratio sweep:
    the chat shape it runs)."""
    defaults = {"rate": math.inf, "mode": "disaggregated", "workload": "chat" if args.sweep == "ratio" else "mixed",
                "scale": 1.0, "num_turns": 4}
    return argparse.Namespace(**{**vars(args), **{k: v for k, v in defaults.items() if getattr(args, k) is None}})


def check_writable(args: argparse.Namespace) -> None:
    """ValueError now, not after the runs, when --json or --plot cannot be written."""
    if args.json:
        existed = os.path.exists(args.json)
        try:
            open(args.json, "a", encoding="utf-8").close()
        except OSError as e:
            raise ValueError(f"--json {args.json}: cannot write it ({e.strerror})") from None
        if not existed:
            os.remove(args.json)
    if args.plot:
        if os.path.exists(args.plot) and not os.path.isdir(args.plot):
            raise ValueError(f"--plot {args.plot}: not a directory")
        try:
            os.makedirs(args.plot, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--plot {args.plot}: cannot make the directory ({e.strerror})") from None
        if not os.access(args.plot, os.W_OK):
            raise ValueError(f"--plot {args.plot}: the directory is not writable")


def variant_config(args: argparse.Namespace, variant: str, extra: list[str] = ()):
    """The config of `variant`: the file, --tensor-parallel, --set, then `extra` (a sweep's own settings)."""
    from bench.serving.cluster import variant_values
    from deploy.config import load_config
    degree = []
    if args.tensor_parallel is not None:
        keys = [s.split("=", 1)[0].strip() for s in args.set if s.split("=", 1)[0].strip().endswith(".tensor_parallel")]
        if keys:
            raise ValueError(f"--tensor-parallel {args.tensor_parallel} sets every pool's degree; --set {keys[0]} "
                             "sets one: use either")
        degree = [f"pools.{pool}.tensor_parallel={args.tensor_parallel}" for pool in ("prefill", "decode")]
    # the SLO flags are the cluster's `slo` too (what auto placement and the autoscaler aim at), as in bench serve
    return load_config(args.config, variant_values(None, None, [*degree, *args.set, *router_slo(args), *extra],
                                                   variant))


def time_model(args: argparse.Namespace, cfg) -> tuple[StepTimeModel, ModelConfig]:
    """The step-time model the flags ask for (at degree 1; each pool's actors use `at_degree` of the pool's
    `tensor_parallel`; with --shared-host, every actor on one host), and the simulated model's shape."""
    if args.hardware:
        from bench.simulate.hardware import Hardware
        from bench.simulate.models import model_config
        from bench.simulate.roofline import RooflineModel
        shape = model_config(args.model or cfg.model.name)
        from deploy.launcher import engine_args
        model = RooflineModel(Hardware.load(args.hardware), shape, dtype=args.dtype or "bf16",
                              inter_node=not args.intra_node,
                              model_name=args.model or cfg.model.name)         # degree 1: at_degree gives the rest
        # the decode pool's storage (quantization, KV dtype and budget) for the planner; each actor takes its own
        model = model.for_engine(engine_args(cfg, "decode", cfg.model.name, shape), cfg.pool_kv_cache("decode"))
    else:
        from deploy.profiler import default_profile_path
        from engine.model.presets import resolve_model
        path = args.profile or default_profile_path(cfg)
        if not os.path.isfile(path):
            raise ValueError(f"no measured profile at {path}: run `pdserve profile --local` for this config, pass "
                             "--profile FILE, or simulate a GPU with --hardware")
        model = MeasuredModel.from_file(path)
        shape = ModelConfig.from_dir(resolve_model(cfg.model.name))
        check_profiled_shape(path, model, shape, cfg.model.name)
    return (model.with_shared_host() if args.shared_host else model), shape


SHAPE_FIELDS = ("num_layers", "hidden_size", "attn_dim", "layer_params", "head_params")


def check_profiled_shape(path: str, model: MeasuredModel, shape: ModelConfig, name: str) -> None:
    """ValueError when the profile measured a model of another shape than the config's `model.name`: its
    times would be taken for a model they do not time (the profile file names no model, only its shape)."""
    from engine.cost_model import ModelCosts
    measured = model.profile.data["decode"]["engine"]
    costs = measured["costs"]
    expected = ModelCosts.of(shape, costs.get("dtype_bytes", 2))
    differ = [k for k in SHAPE_FIELDS if costs.get(k) != getattr(expected, k)]
    if differ:
        raise ValueError(f"{path} measured another model ({measured.get('model_dir', '?')}) than the config's "
                         f"model.name {name}: {differ[0]} {costs.get(differ[0])} against {getattr(expected, differ[0])}"
                         "; profile that model (`pdserve profile --local` with this config), or pass its profile")


def speculation_of_variants(args: argparse.Namespace, variants: list[str], model: StepTimeModel) -> dict:
    """Each variant's speculative decoding as its actors will run it (`sim_spec.speculation_for`), printed in
    the report's header; ValueError where it is on without an acceptance, or where --spec-acceptance is given
    and every variant has it off."""
    if args.spec_acceptance is not None and not 0.0 <= args.spec_acceptance <= 1.0:
        raise ValueError(f"--spec-acceptance {args.spec_acceptance:g}: an acceptance rate is accepted / proposed "
                         "tokens, between 0 and 1")
    profile = model.profile.data if isinstance(model, MeasuredModel) else None
    out = {}
    for variant in variants:
        cfg = variant_config(args, variant)
        _, shape = time_model(args, cfg)
        spec = speculation_for(cfg, shape, profile, args.spec_acceptance)
        if spec is not None:
            source = "--spec-acceptance" if args.spec_acceptance is not None else "the profile's measurement"
            print(f"speculative decoding ({variant}): {describe_speculation(spec)}, from {source}", file=sys.stderr)
            out[variant] = {"method": spec.method, "num_tokens": spec.num_tokens, "adaptive": spec.adaptive,
                            "acceptance": spec.acceptance, "per_token_acceptance": spec.alpha,
                            "draft_cost": spec.draft_cost}
    if args.spec_acceptance is not None and not out:
        raise ValueError("--spec-acceptance: speculative.method is off in every variant (set it with --set "
                         "speculative.method=ngram, or compare a -spec variant: colocated-spec, disaggregated-spec)")
    return out


def workload(args: argparse.Namespace, prompt_len: int | None = None, output_len: int | None = None) -> list:
    if args.workload == MULTI_TURN:
        return make_conversations(args.num_requests, args.num_turns, args.seed, args.scale,
                                  output_len or args.output_len)
    specs = make_workload(args.workload, args.num_requests, args.seed, args.scale,
                          prompt_len or args.prompt_len, output_len or args.output_len)
    texts = sum(s.prompt_token_ids is None for s in specs)
    if texts:
        raise ValueError(f"--workload {args.workload}: {texts} of {len(specs)} requests give a prompt's text; the "
                         "simulator needs its length in tokens: give \"prompt_len\" instead of \"prompt\"")
    return specs


def tokens_needed(item) -> int:
    """Prompt + output tokens of a request, or of a conversation's last turn (its whole history)."""
    if hasattr(item, "output_lens"):
        return len(item.first_prompt) + sum(map(len, item.user_messages)) + sum(item.output_lens)
    return item.prompt_len + item.output_len


def check_context(args: argparse.Namespace, specs: list, context: int) -> None:
    """ValueError when requests of the workload need more tokens than the model's context: the real router
    would refuse each of them (INVALID_ARGUMENT), and a run of refusals answers nothing."""
    over = [n for n in map(tokens_needed, specs) if n > context]
    if over:
        what = "conversations (their last turn)" if hasattr(specs[0], "output_lens") else "requests"
        raise ValueError(f"--workload {args.workload}: {len(over)} of {len(specs)} {what} need more tokens "
                         f"(prompt + output, up to {max(over):,}) than the model's context of {context:,}, and the "
                         "router would refuse them: lower --scale, set --prompt-len / --output-len, or simulate a "
                         "model with a longer context (--model with --hardware, model.max_model_len)")


def lengths_of(specs: list) -> dict:
    if specs and hasattr(specs[0], "output_lens"):
        return {"conversations": len(specs), "turns": sum(c.num_turns for c in specs)}
    return describe(specs)


# ---------------------------------------------------------------- runs

class Ask(NamedTuple):
    """One run of a sweep: `variant` over `specs` at `rate`, with `counts` actors per pool and `extra` settings."""

    variant: str
    specs: list
    rate: float
    counts: dict | None = None
    label: str = ""
    extra: tuple[str, ...] = ()


def run_all(args, asks: list[Ask]) -> list[SimRun]:
    """`run_one` for each ask, --jobs at a time (bench/simulate/parallel.py), in the order asked."""
    if len(asks) > 1 and args.jobs > 1 and args.progress:
        args = argparse.Namespace(**{**vars(args), "progress": False})    # (runs side by side: their lines only)
    return map_runs(functools.partial(_run_ask, args), asks)


def _run_ask(args, ask: Ask) -> SimRun:
    return run_one(args, ask.variant, ask.specs, ask.rate, ask.counts, ask.label, ask.extra)


def run_one(args, variant: str, specs: list, rate: float, counts: dict | None = None, label: str = "",
            extra: list[str] = ()) -> SimRun:
    cfg = variant_config(args, variant, extra)
    model, shape = time_model(args, cfg)
    mode, chunked = VARIANT_MODES[variant]
    run = simulate(cfg, model, shape, specs, rate=rate, mode=mode, chunked=chunked, seed=args.seed,
                   burstiness=args.burstiness, slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=args.slo_tpot_ms / 1e3,
                   counts=counts, label=label or variant, progress=args.progress, timeout_s=args.timeout,
                   autoscale=autoscale_settings(args), actor_start_s=args.actor_start_s,
                   spec_acceptance=args.spec_acceptance)
    s = run.summary
    def ms(seconds: float, digits: int) -> str:          # (nan: no request completed)
        return f"{seconds * 1e3:.{digits}f} ms" if math.isfinite(seconds) else "–"
    print(f"{run.label} @ {rate:g} {rate_unit(specs)}: TTFT p50 {ms(s['ttft_p50_s'], 1)}, TPOT p50 "
          f"{ms(s['tpot_p50_s'], 2)}, SLO attainment {s['slo_attainment'] * 100:.0f}% "
          f"({len(run.records)} requests in {run.wall_s:.1f} s wall, {run.requests_per_wall_s:.0f} req/s)"
          + (f"; {len(run.flips)} role flip{'s' * (len(run.flips) > 1)}" if run.flips else ""), file=sys.stderr)
    if s["failed"]:              # (the router refused or failed them, as it would a client's: say why)
        print(f"{run.label} @ {rate:g} req/s: {s['failed']} of {len(run.records)} requests failed, e.g. "
              f"{s['errors'][0]}", file=sys.stderr)
    return run


def per_arrival(specs: list) -> float:
    """Requests an arrival brings: a conversation's turns (multi-turn, whose rate is conversations/s), else 1."""
    if specs and hasattr(specs[0], "output_lens"):
        return sum(len(c.output_lens) for c in specs) / len(specs)
    return 1.0


def rate_unit(specs: list) -> str:
    return "conversations/s" if specs and hasattr(specs[0], "output_lens") else "req/s"


def capacity(args, variant: str, specs: list, counts: dict | None = None, extra: list[str] = ()) -> float:
    """Arrivals/s the variant completes with every request sent at once (requests/s; multi-turn: conversations/s,
    the unit of --rate)."""
    return capacities(args, [Ask(variant, specs, math.inf, counts, f"{variant} capacity", tuple(extra))])[0]


def capacities(args, asks: list[Ask]) -> list[float]:
    """`capacity` of each ask (its rate is not read: every request is sent at once), --jobs at a time."""
    runs = run_all(args, [a._replace(rate=math.inf, label=a.label or f"{a.variant} capacity") for a in asks])
    return [r.summary["completed"] / r.duration_s / per_arrival(a.specs) if r.duration_s > 0 else 0.0
            for a, r in zip(asks, runs)]


class Series(NamedTuple):
    """A variant run at several rates (one line of a sweep)."""

    variant: str
    specs: list
    rates: list[float]
    counts: dict | None = None
    extra: tuple[str, ...] = ()


def rate_points(args, series: dict[str, Series]) -> dict[str, list[dict]]:
    """Each series (by label) at each of its rates: the figures per rate. Every run of every series goes
    out at once, --jobs at a time."""
    asks = [Ask(s.variant, s.specs, rate, s.counts, label, s.extra) for label, s in series.items() for rate in s.rates]
    points: dict[str, list[dict]] = {label: [] for label in series}
    for ask, run in zip(asks, run_all(args, asks)):
        points[ask.label].append({"x": ask.rate, **{k: run.summary[k] for k in FIGURES}})
    return points


BURST_SHARE = 0.5   # a held point whose run completed under this share of the offered rate measured a burst


def bursts(points: dict[str, list[dict]], per_arrival: float = 1.0) -> list[dict]:
    """The points that held the SLOs (>= 90 % attainment) while their run completed under half the rate
    offered: the requests came faster than the layout finished them, and the run ended draining the backlog
    (a request that waits for a decode slot after its first token spreads the wait over its TPOT). Their
    attainment is a burst's, not a rate the layout sustains. Rates are arrivals/s (`per_arrival` requests each)."""
    return [{"label": label, "rate_rps": p["x"], "completed_rps": p["request_throughput_rps"] / per_arrival}
            for label, rows in points.items() for p in rows
            if p["slo_attainment"] >= ATTAINMENT and p["request_throughput_rps"] / per_arrival < BURST_SHARE * p["x"]]


def print_bursts(found: list[dict], specs: list) -> None:
    if not found:
        return
    worst = min(found, key=lambda b: b["completed_rps"] / b["rate_rps"])
    unit = rate_unit(specs)
    print(f"note: {len(found)} point(s) held 90% attainment while completing under half the offered rate (e.g. "
          f"{worst['label']} at {worst['rate_rps']:g} {unit} completed {worst['completed_rps']:.3g}): with "
          f"{len(specs)} {'conversations' if unit != 'req/s' else 'requests'} those runs measure a burst, not a "
          "sustained rate; raise --num-requests (thousands) before reading max rates")


def sweep_rates(args, variants: list[str], specs: list) -> dict:
    values = float_list("--sweep-values", args.sweep_values or "")
    if not values:
        values = rates_around(capacity(args, variants[0], specs))
    points = rate_points(args, {v: Series(v, specs, values) for v in variants})
    print_points("rate", points)
    held = {v: max_rate_rps(rows) for v, rows in points.items()}
    for v, m in held.items():
        print(f"{v}: max rate at >= 90% SLO attainment {m['max_rate_rps']:.3g} {rate_unit(specs)}"
              f"{'' if m['bounded'] else ' (every rate held it: a lower bound)'}")
    found = bursts(points, per_arrival(specs))
    print_bursts(found, specs)
    return {"sweep": "rate", "values": values, "points": points, "max_rate_rps": held, "bursts": found}


def degrees_of(text: str) -> tuple[int, ...]:
    try:
        degrees = tuple(sorted({int(d) for d in text.split(",") if d.strip()}))
    except ValueError:
        raise ValueError(f"--tp: {text!r} is not a list of degrees (e.g. 1,2,4)") from None
    if not degrees or degrees[0] < 1:
        raise ValueError(f"--tp: {text!r}: degrees are integers of at least 1")
    return degrees


def split_label(tp_p: int, n_p: int, tp_d: int, n_d: int) -> str:
    return f"{n_p}P{n_d}D @tp{tp_p}/{tp_d}"


def sweep_split(args, specs: list) -> dict:
    """Every (TP_p, n_p, TP_d, n_d) with TP_p·n_p + TP_d·n_d ≤ --devices, and colocated at each degree (devices
    ÷ degree engines), at rates per device common to all (--sweep-values: the rates offered to all --devices;
    a candidate on fewer gets them in proportion); the best per device beside the planner's choice.

    The planner's search on the same time model (`search_with_model`) ranks the split candidates; those whose
    degrees it says cannot meet the SLOs, and those past the top --top, are listed but not simulated."""
    n = args.devices or 4
    if not 2 <= n <= MAX_SPLIT_DEVICES:
        raise ValueError(f"--devices {n}: --sweep split takes 2 to {MAX_SPLIT_DEVICES} devices (it lists every split, "
                         "about devices² / 2 of them, and runs devices ÷ degree colocated engines)")
    cfg = variant_config(args, "disaggregated")
    model, shape = time_model(args, cfg)
    degrees, refused = usable_degrees(model, degrees_of(args.tp or "1"), cfg.pool_kv_cache("decode").block_size)
    for d, why in refused.items():
        print(f"--tp: leaving out degree {d}: {why}", file=sys.stderr)
    for d in [d for d in degrees if d > n]:
        print(f"--tp: leaving out degree {d}: more than the {n} devices", file=sys.stderr)
    degrees = [d for d in degrees if d <= n]
    if not degrees:
        raise ValueError(f"--tp {args.tp}: no degree an actor of this model can run at")
    search = ParallelismSearch(n, tuple(degrees))
    flat = [s for s in specs if hasattr(s, "output_len")]
    profile = model.profile.data if isinstance(model, MeasuredModel) else None
    speculation = speculation_for(cfg, shape, profile, args.spec_acceptance)
    planned = search_with_model(cfg, model, shape, flat, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3,
                                search, speculation) if flat else []
    predicted = {(c.prefill_degree, c.n_prefill, c.decode_degree, c.n_decode): c.goodput_per_device for c in planned}
    every = [(a, n_p, b, n_d) for a in degrees for b in degrees for n_p in range(1, (n - b) // a + 1)
             for n_d in range(1, (n - n_p * a) // b + 1)]
    if flat:
        ranked = sorted((c for c in every if c in predicted), key=lambda c: -predicted[c])
        top = 8 if args.top is None else args.top
        chosen = ranked if top <= 0 else ranked[:top]
    else:                    # (conversations: the planner has no mean lengths; every candidate runs)
        chosen = every
    candidates = {split_label(*c): {"kind": "split", "prefill_degree": c[0], "n_prefill": c[1],
                                    "decode_degree": c[2], "n_decode": c[3], "devices": c[0] * c[1] + c[2] * c[3],
                                    "planned_per_device": predicted.get(c)} for c in chosen}
    for d in degrees:
        candidates[f"colocated {n // d}×tp{d}"] = {"kind": "colocated", "prefill_degree": d, "n_prefill": 0,
                                                  "decode_degree": d, "n_decode": n // d, "devices": n // d * d,
                                                  "planned_per_device": None}

    def settings(c: dict) -> tuple[str, ...]:
        return (f"pools.prefill.tensor_parallel={c['prefill_degree']}",
                f"pools.decode.tensor_parallel={c['decode_degree']}")

    per_device = [v / n for v in float_list("--sweep-values", args.sweep_values or "")]
    if not per_device:       # 0.375-1.875x the most per device that colocated completes or the planner predicts
        colocated = [c for c in candidates.values() if c["kind"] == "colocated"]
        completed = capacities(args, [Ask("colocated-chunked", specs, math.inf, {"prefill": 0, "decode": c["n_decode"]},
                                          extra=settings(c)) for c in colocated])
        most = max([rps / c["devices"] for rps, c in zip(completed, colocated)]
                   + [c.goodput_per_device for c in planned[:1]])
        per_device = rates_around(most * 1.5)
    print(f"{len(every)} splits within {n} devices at degrees {', '.join(map(str, degrees))}; simulating "
          f"{len(chosen)}" + (f" (the planner's top {len(chosen)} of {len(predicted)} that it says meet the SLOs; "
                              f"{len(every) - len(predicted)} it says cannot)" if flat and len(chosen) < len(every)
                              else "") + " and colocated at each degree", file=sys.stderr)
    points = rate_points(args, {label: Series("colocated-chunked" if c["kind"] == "colocated" else "disaggregated",
                                              specs, [round(v * c["devices"], 4) for v in per_device],
                                              {"prefill": c["n_prefill"], "decode": c["n_decode"]}, settings(c))
                                for label, c in candidates.items()})
    held = {k: max_rate_rps(v) for k, v in points.items()}
    for k, c in candidates.items():
        lowest = min(points[k], key=lambda p: p["x"])
        c.update(max_rate_rps=held[k]["max_rate_rps"], bounded=held[k]["bounded"],
                 per_device=held[k]["max_rate_rps"] / c["devices"],
                 below_lowest=lowest["slo_attainment"] < ATTAINMENT)     # (its figure is a guess below that rate)
    print_points("rate", points)
    held_some = [k for k, c in candidates.items() if not c["below_lowest"]]
    best = max(held_some, key=lambda k: (candidates[k]["per_device"], -candidates[k]["devices"])) \
        if held_some else None
    print(f"\nmax rate at >= 90% SLO attainment within {n} devices (≥: every rate held it; <: not even the "
          "lowest did; rates per device: "
          f"{', '.join(f'{v:g}' for v in per_device)})")
    unit = rate_unit(specs)
    width = max(9, len(unit))
    print(f"  {'candidate':<22} {'devices':>7} {unit:>{width}} {'per device':>11} {'plan predicts':>14}")
    for k, c in sorted(candidates.items(), key=lambda kv: -kv[1]["per_device"]):
        plan_cell = "–" if c["planned_per_device"] is None else f"{c['planned_per_device']:.3g}"
        mark = "<" if c["below_lowest"] else "" if c["bounded"] else "≥"
        rate, per = (min(p["x"] for p in points[k]), per_device[0]) if c["below_lowest"] else \
            (c["max_rate_rps"], c["per_device"])
        print(f"  {k:<22} {c['devices']:>7} {mark + format(rate, '.3g'):>{width}} {mark + format(per, '.3g'):>11} "
              f"{plan_cell:>14}" + ("  ← best" if k == best else ""))
    left = [c for c in every if c not in chosen]
    if left:
        print(f"  not simulated: {len(left)} splits" + (f", of which {sum(c not in predicted for c in left)} the "
                                                         "planner says cannot meet the SLOs" if flat else ""))
    plan = planned_choice(planned, search) if flat else "not run: the planner takes requests of fixed lengths, " \
        "not conversations"
    if best is None:
        said = "best: none held 90% attainment at the lowest rate (lower --sweep-values)"
    else:
        b = candidates[best]
        ties = sum(1 for k in held_some if k != best and candidates[k]["per_device"] >= b["per_device"] * (1 - 1e-9))
        said = f"best: {best} ({b['per_device']:.3g} {unit} per device{'' if b['bounded'] else ', a lower bound'}" + \
            (f"; {ties} more hold as much: offer higher --sweep-values to part them)" if ties else ")")
    print(f"{said}; pdserve plan --devices {n} --tp {','.join(map(str, degrees))}: {plan}")
    found = bursts(points, per_arrival(specs))
    print_bursts(found, specs)
    return {"sweep": "split", "devices": n, "degrees": degrees, "rates_per_device": per_device, "points": points,
            "max_rate_rps": held, "candidates": candidates, "not_simulated": [split_label(*c) for c in left],
            "best": best, "plan": plan, "bursts": found}


def planned_choice(planned: list, search: ParallelismSearch) -> str:
    """The planner's choice, as the sweep labels it, with the req/s per device it predicts."""
    if not planned:
        return "no degree and count meets both SLOs within the devices"
    c = planned[0]
    return (f"{split_label(c.prefill_degree, c.n_prefill, c.decode_degree, c.n_decode)} "
            f"(predicts {c.goodput_per_device:.3g} req/s per device)")


DEFAULT_RATIOS = "200:200,1000:200,2000:200,5000:500,10000:1000"


def sweep_ratio(args) -> dict:
    """Disaggregated vs colocated (chunked) at each prompt:output ratio, at equal actors. Each variant's
    rates run from 0.375x to 1.875x the larger of the two capacities; a figure every rate held is a lower bound
    (≥)."""
    cfg = variant_config(args, "colocated")
    _, shape = time_model(args, cfg)
    context = context_of(cfg, shape)
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
    variants = ("colocated-chunked", "disaggregated")
    workloads = [make_workload("chat", args.num_requests, args.seed, 1.0, *pair) for pair in pairs]
    caps = capacities(args, [Ask(v, specs, math.inf) for specs in workloads for v in variants])
    n = len(variants)
    series = {(pair, v): Series(v, specs, rates_around(max(caps[i * n:(i + 1) * n]) * 1.5))
              for i, (pair, specs) in enumerate(zip(pairs, workloads)) for v in variants}
    points = rate_points(args, {f"{p}:{o} {v}": s for ((p, o), v), s in series.items()})
    rows = []
    for prompt_len, output_len in pairs:
        held = {v: max_rate_rps(points[f"{prompt_len}:{output_len} {v}"]) for v in variants}
        rate = {v: m["max_rate_rps"] for v, m in held.items()}
        gain = rate["disaggregated"] / rate["colocated-chunked"] if rate["colocated-chunked"] else math.inf
        rows.append({"prompt_len": prompt_len, "output_len": output_len, **rate, "gain": gain,
                     "bounded": {v: m["bounded"] for v, m in held.items()}})
    print(f"\n{'prompt:output':>14} {'colocated':>11} {'disagg.':>11} {'disagg./coloc.':>15}   (req/s at >= 90% SLO; "
          "≥: every rate held it, so the ratio is a bound too; ?: both held every rate)")
    for r in rows:
        def cell(v: str) -> str:
            return ("" if r["bounded"][v] else "≥") + f"{r[v]:.3g}"
        ratio_mark = {(True, True): "", (True, False): "≥", (False, True): "≤", (False, False): "?"}[
            (r["bounded"]["colocated-chunked"], r["bounded"]["disaggregated"])]
        print(f"{r['prompt_len']:>8}:{r['output_len']:<5} {cell('colocated-chunked'):>11} {cell('disaggregated'):>11} "
              f"{ratio_mark + format(r['gain'], '.2f'):>14}×")
    return {"sweep": "ratio", "rows": rows}


def request_records(records: list, args: argparse.Namespace) -> list[dict]:
    """Each request's record as bench serve's --json keeps it, less its gaps between tokens (a token's worth of
    floats a request: the summary's ITL percentiles hold them). A sweep's runs keep their figures only."""
    slo = args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3
    return [{**{k: v for k, v in rec.to_dict().items() if k != "itl_s"}, "meets_slo": meets_slo(rec, *slo)}
            for rec in records]


def plot(result: dict, out_dir: str, title: str) -> str | None:
    if result.get("sweep") not in ("rate", "split"):
        return None
    from bench.serving.plots import plot_slo_attainment
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"simulate_{result['sweep']}.png")
    return plot_slo_attainment(result["points"], path, title)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.progress is None:
        args.progress = sys.stderr.isatty()
    try:
        check_flags(args)
        args = with_defaults(args)
        with jobs(args.jobs):
            result, model, speculation = _simulate(args)
        result.update(time_model=model.name, workload=args.workload, rate=args.rate, seed=args.seed,
                      slo={"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}, speculation=speculation)
        if args.plot:
            path = plot(result, args.plot, f"{args.workload}, {model.name}")
            if path:
                result["plot"] = path
                print(f"wrote {path}", file=sys.stderr)
        if args.json:       # strict JSON: nan and inf (a rate of "all at once") become null
            write_json(args.json, result)
            print(f"wrote {args.json}", file=sys.stderr)
    except (ValueError, ConfigError, OSError, WorkerLost) as e:      # OSError: a file named on the command line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def _simulate(args) -> tuple[dict, StepTimeModel, dict | None]:
    """What the command line asks for: (the result to print and write, the time model, the speculation)."""
    cfg = variant_config(args, args.mode)
    model, shape = time_model(args, cfg)
    variants = list(dict.fromkeys(v.strip() for v in (args.compare or args.mode).split(",") if v.strip()))
    unknown = [v for v in variants if v not in VARIANT_MODES]
    if unknown or not variants:
        raise ValueError(f"--compare: {f'unknown variant {unknown[0]!r}' if unknown else 'no variant'}; "
                         f"use {', '.join(VARIANT_MODES)}")
    layouts = {}            # every variant's pools, checked before any run (a TP degree with role flips, ...)
    for v in variants:
        mode = VARIANT_MODES[v][0]
        layouts[v] = PoolModels.of(model, tensor_parallel_degrees(variant_config(args, v), mode), mode == "colocated")
    described = {v: pools.describe() for v, pools in layouts.items()
                 if set(pools.degrees.values()) != {1}} if args.sweep != "split" else {}
    if len(set(described.values())) == 1 and len(described) == len(variants):
        detail = f"; {next(iter(described.values()))}"
    else:
        detail = "".join(f"; {v}: {d}" for v, d in described.items())
    print(f"time model: {model.name}{detail}", file=sys.stderr)
    speculation = speculation_of_variants(args, variants, model)
    if args.sweep == "ratio":
        result = sweep_ratio(args)
    else:
        specs = workload(args)
        check_context(args, specs, context_of(cfg, shape))
        if args.sweep == "split":
            result = sweep_split(args, specs)
        elif args.sweep == "rate":
            result = sweep_rates(args, variants, specs)
        else:
            runs = dict(zip(variants, run_all(args, [Ask(v, specs, args.rate) for v in variants])))
            summaries = {v: r.summary for v, r in runs.items()}
            print(table(summaries, ratio_of="disaggregated" if "disaggregated" in summaries else None))
            result = {"runs": summaries, "actors": {v: r.actors for v, r in runs.items()},
                      "wall_s": {v: r.wall_s for v, r in runs.items()},
                      "roles_over_time": {v: r.roles for v, r in runs.items()},
                      "flips": {v: r.flips for v, r in runs.items()},
                      "records": {v: request_records(r.records, args) for v, r in runs.items()}}
        lengths = lengths_of(specs)
        if "input_len" in lengths:
            print(lengths_line(lengths))
        result["lengths"] = lengths
    return result, model, speculation


if __name__ == "__main__":
    sys.exit(main())
