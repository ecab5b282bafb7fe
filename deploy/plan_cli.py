"""`pdserve profile` and `pdserve plan`.

    pdserve profile [--config F] [--out FILE] [--local] [--tp 1,2]
        Measure on one actor of each pool (Ray, the pools' resources); --local measures
        in-process engines built from the same EngineArgs instead (no Ray). --tp also measures
        both pools at each further tensor-parallel degree (the planner then uses those points).
        Saves the profile to FILE, default the config's cached profile (see default_profile_path).
    pdserve plan [--config F] [--model M] [--profile FILE] [--json] [--local] [--spec-acceptance A]
                 [--devices N [--tp 1,2,4] [--allreduce-us U] [--allreduce-gbps G]]
        Size the pools from FILE, else the cached profile, else profile first (with progress).
        With speculative decoding on, decode is sized at acceptance rate A (accepted / proposed
        tokens), else at the profile's measurement on the model's held-out text, else without a speed-up.
        With --devices: search the tensor-parallel degree and count of each pool within N devices
        for the most goodput per device meeting the SLOs; print the choice and the runner-up.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

from deploy.config import PDServeConfig
from deploy.launcher import engine_args
from deploy.performance import speculation_of
from deploy.planner import (AllReduce, Network, Parallelism, Plan, inputs_from_config, link_kv_bytes_per_s, plan,
                            search_parallelism)
from deploy.profiler import (default_profile_path, load_profile, profile_cluster, profile_local,
                             save_profile)
from engine.model.config import ModelConfig
from engine.model.presets import resolve_model
from engine.performance import MeasuredPerformance
from kv_transfer import wire_bytes_per_kv_byte


def measure(cfg: PDServeConfig, local: bool = False, progress: bool = True, degrees: tuple[int, ...] = (1,)) -> dict:
    run = profile_local if local else profile_cluster
    return run(cfg, progress=progress, degrees=degrees)


def run_profile(cfg: PDServeConfig, out: str | None = None, local: bool = False,
                degrees: tuple[int, ...] = (1,)) -> int:
    try:
        profile = measure(cfg, local, degrees=degrees)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = save_profile(profile, out or default_profile_path(cfg))
    p = MeasuredPerformance(profile)
    print(f"profile saved to {path}: peak prefill {p.peak_flops_per_s / 1e9:.1f} GFLOP/s, "
          f"peak decode {p.peak_bytes_per_s / 1e9:.2f} GB/s, {len(profile['prefill']['points'])} prefill + "
          f"{len(profile['decode']['points'])} decode points ({profile['source']})")
    for degree in p.degrees("prefill")[1:]:
        at = p.at_degree("prefill", degree)
        decode = p.at_degree("decode", degree)
        print(f"  TP {degree}: peak prefill {at.peak_flops_per_s / 1e9:.1f} GFLOP/s, "
              f"peak decode {decode.peak_bytes_per_s / 1e9:.2f} GB/s")
    return 0


def plan_for(cfg: PDServeConfig, profile: dict, spec_acceptance: float | None = None) -> Plan:
    model_dir = resolve_model(cfg.model.name)
    args = engine_args(cfg, "decode", model_dir)
    measured = MeasuredPerformance(profile, speculation_of(cfg, model_dir, profile, spec_acceptance))
    head_dim = ModelConfig.from_dir(model_dir).head_dim
    return plan(measured, *inputs_from_config(cfg, args.num_blocks),
                network=network_for(cfg, measured, args.block_size, head_dim))


def network_for(cfg: PDServeConfig, profile: MeasuredPerformance, block_size: int, head_dim: int) -> Network | None:
    """The link figure: ``kv_transfer.link_gbps`` when set, else the profile's measurement of this
    transport and codec; None when neither is there (the plan then says the term is missing)."""
    t, codec = cfg.kv_transfer, cfg.transfer_codec()
    if t.link_gbps is not None:
        ratio = wire_bytes_per_kv_byte(codec, profile.costs.dtype_bytes, block_size, head_dim)
        return Network(link_kv_bytes_per_s(t.link_gbps, ratio),
                       f"kv_transfer.link_gbps {t.link_gbps:g} Gbit/s, {ratio:.2f} wire bytes per KV byte "
                       f"({codec})")
    measured = profile.transfer
    if (measured.get("transport"), measured.get("codec")) != (t.transport, codec) \
            or not measured.get("kv_bytes_per_s"):
        return None
    return Network(measured["kv_bytes_per_s"], f"measured by pdserve profile: {t.transport}, {codec}, "
                   f"{measured.get('where', 'loopback')}")


def obtain_profile(cfg: PDServeConfig, profile_path: str | None, local: bool = False) -> tuple[dict, str]:
    """(profile, where it came from): the given file, the cached one, or a fresh measurement."""
    if profile_path:
        return load_profile(profile_path), profile_path
    path = default_profile_path(cfg)
    if os.path.isfile(path):
        try:
            return load_profile(path), path
        except ValueError:
            pass
    print("no profile for this config on this machine yet: profiling first", file=sys.stderr)
    return load_profile(save_profile(measure(cfg, local), path)), path


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelismSearch:
    """`pdserve plan --devices`: the device budget, the degrees tried, the all-reduce figure of each."""
    devices: int
    degrees: tuple[int, ...] = (1, 2, 4)
    allreduce_us: float = 30.0
    allreduce_gbps: float = 100.0

    def allreduce(self) -> dict[int, AllReduce]:
        return {d: AllReduce(self.allreduce_us * 1e-6, self.allreduce_gbps * 1e9) for d in self.degrees if d > 1}


def search_for(cfg: PDServeConfig, profile: dict, search: ParallelismSearch,
               spec_acceptance: float | None = None) -> list[Parallelism]:
    model_dir = resolve_model(cfg.model.name)
    args = engine_args(cfg, "decode", model_dir)
    mcfg = ModelConfig.from_dir(model_dir)
    measured = MeasuredPerformance(profile, speculation_of(cfg, model_dir, profile, spec_acceptance))
    degrees = [d for d in search.degrees if mcfg.num_attention_heads % d == 0 and
               (mcfg.num_key_value_heads % d == 0 or d % mcfg.num_key_value_heads == 0)]
    return search_parallelism(measured, *inputs_from_config(cfg, args.num_blocks), search.devices, degrees,
                              search.allreduce(), network_for(cfg, measured, args.block_size, mcfg.head_dim))


def measured_degrees(profile: dict, search: ParallelismSearch) -> dict[str, list[int]]:
    """Per pool, the degrees tried whose times come from the profile's points (the rest are predicted)."""
    measured = MeasuredPerformance(profile)
    return {pool: [d for d in search.degrees if d in measured.degrees(pool)] for pool in ("prefill", "decode")}


def format_search(found: list[Parallelism], search: ParallelismSearch,
                  measured: dict[str, list[int]] | None = None) -> str:
    measured = measured or {"prefill": [1], "decode": [1]}
    lines = [f"Parallelism within {search.devices} devices (degrees tried: "
             f"{', '.join(map(str, search.degrees))}; all-reduce {search.allreduce_us:g} µs + bytes / "
             f"{search.allreduce_gbps:g} GB/s, --allreduce-us / --allreduce-gbps)"]
    lines += [f"  {pool} measured at TP {', '.join(map(str, degrees)) or 'none'}; other degrees predicted "
              f"from TP 1 (pdserve profile --tp measures them)" for pool, degrees in measured.items()]
    if not found:
        return "\n".join(lines + ["  no degree and count meets both SLOs within the devices"])
    for label, c in zip(("chosen", "runner-up"), found):
        lines.append(f"  {label:<9}: prefill TP {c.prefill_degree} × {c.n_prefill}, decode TP {c.decode_degree} × "
                     f"{c.n_decode} = {c.devices} devices; {c.goodput_rps:.2f} req/s within the SLOs, "
                     f"{c.goodput_per_device:.3f} req/s per device")
    return "\n".join(lines)


def run_plan(cfg: PDServeConfig, as_json: bool = False, profile_path: str | None = None, local: bool = False,
             search: ParallelismSearch | None = None, spec_acceptance: float | None = None) -> int:
    if spec_acceptance is not None and not 0.0 <= spec_acceptance <= 1.0:
        print(f"error: --spec-acceptance {spec_acceptance:g}: an acceptance rate (accepted / proposed tokens) "
              "between 0 and 1", file=sys.stderr)
        return 2
    if spec_acceptance is not None and cfg.speculative.method == "off":
        print(f"error: --spec-acceptance {spec_acceptance:g}: sizes speculative decoding, which is off (turn it on "
              "with --speculative-method ngram|draft or config speculative.method)", file=sys.stderr)
        return 2
    try:
        profile, source = obtain_profile(cfg, profile_path, local)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if search is not None:
        found = search_for(cfg, profile, search, spec_acceptance)
        measured = measured_degrees(profile, search)
        if as_json:
            print(json.dumps({"profile": source, "model": cfg.model.name, "devices": search.devices,
                              "measured_degrees": measured,
                              "candidates": [{k: getattr(c, k) for k in ("prefill_degree", "n_prefill",
                                                                         "decode_degree", "n_decode", "devices",
                                                                         "goodput_rps", "goodput_per_device")}
                                             for c in found[:2]]}, indent=2))
        else:
            print(format_search(found, search, measured))
        return 0 if found else 1
    result = plan_for(cfg, profile, spec_acceptance)
    if as_json:
        print(json.dumps({"profile": source, "model": cfg.model.name, **result.to_dict()}, indent=2))
    else:
        print(format_plan(result, cfg.model.name, source))
    return 0


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def _table(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    rule = "+" + "-" * (width + 2) + "+" + "-" * (vwidth + 2) + "+"
    return [title, rule, *(f"| {k:<{width}} | {v:>{vwidth}} |" for k, v in rows), rule, ""]


def format_plan(p: Plan, model: str, source: str) -> str:
    led, w = p.ledger, p.workload
    bound = "compute" if led["prefill_arithmetic_intensity"] > led["machine_balance_flops_per_byte"] else "memory"
    dbound = "compute" if led["decode_arithmetic_intensity"] > led["machine_balance_flops_per_byte"] else "memory"
    lines = [f"pdserve plan — model {model}; workload {w['input_tokens']:.0f} in / {w['output_tokens']:.0f} out "
             f"tokens at {w['arrival_rate_rps']:g} req/s; SLO TTFT p99 {p.slo['ttft_s'] * 1e3:.0f} ms, "
             f"TPOT p99 {p.slo['tpot_s'] * 1e3:.0f} ms", f"profile: {source}", ""]
    lines += _table("Ledger", [
        ("prefill FLOPs per request", _si(led["prefill_flops_per_request"], "FLOP")),
        ("prefill time per request (measured)", f"{led['prefill_seconds_per_request'] * 1e3:.1f} ms"),
        ("prefill achieved", _si(led["prefill_flops_per_s"], "FLOP/s")),
        ("prefill arithmetic intensity", f"{led['prefill_arithmetic_intensity']:.1f} FLOP/B ({bound}-bound)"),
        ("decode mean context", f"{led['decode_context_mean']:.0f} tokens"),
        ("decode bytes per step (weights + KV)", _si(led["decode_bytes_per_step"], "B")),
        ("  of which weights", _si(led["decode_weight_bytes"], "B")),
        ("decode step, theoretical (bytes / peak)", f"{led['decode_theoretical_step_s'] * 1e3:.1f} ms"),
        ("decode step, measured", f"{led['decode_measured_step_s'] * 1e3:.1f} ms"),
        ("decode achieved", _si(led["decode_bytes_per_s"], "B/s")),
        ("decode arithmetic intensity", f"{led['decode_arithmetic_intensity']:.1f} FLOP/B ({dbound}-bound)"),
        ("KV bytes per token", _si(led["kv_bytes_per_token"], "B")),
        ("KV bytes per request (prompt + max_tokens)", _si(led["kv_bytes_per_request"], "B")),
        ("machine peak (measured)", f"{_si(led['peak_flops_per_s'], 'FLOP/s')}, {_si(led['peak_bytes_per_s'], 'B/s')}"),
        ("machine balance point", f"{led['machine_balance_flops_per_byte']:.1f} FLOP/B"),
    ])
    d, f = p.decode, p.prefill
    spec = d.get("speculation") or {}
    spec_rows = [(f"speculative decoding ({spec['method']}, acceptance {spec['acceptance']:.2f})",
                  f"k {spec['step_num_tokens']} of {spec['num_tokens']}, {spec['tokens_per_step']:.2f} tokens/step"),
                 ("decode time per token", f"{d['token_s'] * 1e3:.1f} ms")] if spec else []
    lines += _table("Per actor", [
        ("decode batch (TPOT SLO, KV budget)", f"{d['batch']} (KV allows {d['kv_limit']}, max {d['max_batch_size']})"),
        *spec_rows,
        ("decode tokens/s per actor", f"{d['tokens_per_s_per_actor']:.1f}"),
        ("prefill capacity tokens/s per actor", f"{f['capacity_tokens_per_s']:.1f}"),
        ("prefill utilization at TTFT SLO", f"{f['utilization']:.0%}"),
        ("prefill tokens/s per actor at SLO", f"{f['tokens_per_s_per_actor']:.1f}"),
        ("predicted p99 TTFT", f"{f['predicted_p99_ttft_s'] * 1e3:.0f} ms"
         + ("" if f["ttft_slo_met"] else " (SLO not met)")),
    ])
    lines += _table("Counts", [
        ("prefill actors (needed → planned)", f"{p.needed_prefill:.2f} → {p.n_prefill}"),
        ("decode actors (needed → planned)", f"{p.needed_decode:.2f} → {p.n_decode}"),
        ("prefill : decode (needed)", f"{p.ratio:.2f}"),
    ])
    if p.network:
        n = p.network
        lines += _table("Network (prompt KV from prefill to decode)", [
            ("KV bytes per request (prompt)", _si(n["kv_bytes_per_request"], "B")),
            ("link, KV bytes/s", _si(n["kv_bytes_per_s"], "B/s")),
            ("  from", n["source"]),
            ("handoff time per request", f"{n['seconds_per_request'] * 1e3:.1f} ms"),
        ])
    if p.rate_bounds:
        binding = min(p.rate_bounds, key=p.rate_bounds.get)
        lines += _table("Request rate the plan carries", [
            *((f"{name} at most", f"{rate:.2f} req/s" + (" ← binds" if name == binding else ""))
              for name, rate in p.rate_bounds.items()),
        ])
    lines.append("Reasoning")
    lines += [f"  - {r}" for r in p.reasons]
    return "\n".join(lines)
