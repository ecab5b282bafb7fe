"""Profile the pools on this hardware: the measured points behind `engine.performance.MeasuredPerformance`.

Measuring: prefill FLOP/s vs prompt length, decode step time vs batch size and context length
(→ bytes/s), and the KV link: one prompt's KV through the configured transport and codec
(`deploy.link_profiler`, on this host's loopback). With `speculative.method` on, the decode points
again with k proposals per sequence (the speculative step), and the method's acceptance rate at k
on the model's held-out text where the model directory has some (`engine.profile`). The engine
measurements run on the actual pool actors (`ServingActor.profile`, one point per call so progress
shows) or, with `local=True`, on in-process engines built from the same `EngineArgs`;
`engine.profile` takes each point and `engine.cost_model` counts its FLOPs and bytes.

Reading: `engine.performance.MeasuredPerformance` interpolates the points (prefill seconds(S), decode
step seconds(B, C), the link's bytes/s): the performance model the planner, the autoscaler and auto
placement ask (`deploy.performance` picks the one a cluster starts from).

A profile is a JSON file:

    {"version": 1, "created": ..., "source": "actors" | "local",
     "prefill": {"engine": {...costs, threads, chunk_size...},
                 "points": [{prompt_len, batch, seconds, flops, flops_per_s}]},
     "decode":  {"engine": {...}, "points": [{batch, context, seconds, bytes, bytes_per_s, flops}]},
     "transfer": {transport, codec, kv_bytes, wire_bytes, seconds, kv_bytes_per_s} (or {..., error}),
     "speculative": {"method", "num_tokens": k, "adaptive",                   (with speculative.method on)
                     "points": [{batch, context, num_tokens, seconds, bytes, bytes_per_s, flops,
                                 num_proposed}],                               (num_tokens: 1 and k)
                     "acceptance": {ratio, num_tokens, proposed, accepted, prompts, temperature} | null},
     "degrees": {"2": {"prefill": {"engine", "points"}, "decode": {...}}, ...}   (optional, --tp)
     "calibration": {"prefill": factor, "decode": factor,         (optional, bench.serving.plan_check)
                     "step_s", "handoff_s", "send_s", "send_s_per_mb": fixed costs ≥ 0,
                     "send_curve": [[wire MB, seconds ≥ 0], ...] (MB increasing),
                     "shared_prefill", "shared_decode": factors on a host the actors share}

A profile without "speculative" (made with speculation off, or before it was measured) still serves a
config with speculation on: `engine.performance` then models the speculative step from the plain ones.
The top-level prefill and decode points are the pools at tensor-parallel degree 1; ``"degrees"`` holds
the same points measured with both pools at each further degree (`pdserve profile --tp 1,2`: one actor
of N ranks, or locally rank 0 here and N - 1 follower processes). The planner's `DegreeModel` reads a
measured degree from there and predicts the others from degree 1.

`default_profile_path(cfg)` names the cached profile of a config (model, dtype, threads,
KV budget, batch limits and workload lengths): `pdserve plan` reuses it, or profiles first.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

from deploy.config import PDServeConfig
from deploy.launcher import engine_args
from engine.cost_model import ModelCosts
from engine.model.presets import cache_root, resolve_model

PROFILE_VERSION = 1
PREFILL_LENS = (16, 128, 512)      # 16: a short prompt's forward is bound by reading the weights, not its FLOPs
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


# ------------------------------------------------------------ what to measure

def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_points(cfg: PDServeConfig, model_dir: str, quick: bool = False) -> dict[str, list[dict]]:
    """The measurements a plan for `cfg` needs, per pool.

    Prefill: one prompt at a few reference lengths and at the workload's mean (the TTFT
    side), and a saturated step of mean-length prompts (the throughput side). Decode: batch
    sizes up to what the KV budget and `max_batch_size` allow, at the workload's mean
    context (prompt + half the output) and at a short one. Speculative (with
    `speculative.method` on, run on the decode engine): the same decode points with k
    proposals per sequence and with 1, and the acceptance rate at k. Each point keeps its best of
    a few repeats: on a shared machine other work only adds time.
    """
    w = cfg.workload
    s_in, s_out = w.input_tokens_mean, w.output_tokens_mean
    d_args = engine_args(cfg, "decode", model_dir)
    lens = sorted({min(s, 64) if quick else s for s in (*PREFILL_LENS, s_in)})
    prefill = [{"kind": "prefill", "prompt_len": s, "batch": 1, "repeats": 2 if s <= 512 else 1} for s in lens]
    prefill.append({"kind": "prefill", "prompt_len": lens[-1] if quick else s_in, "batch": "saturated", "repeats": 1})
    context = s_in + s_out // 2
    per_request = _blocks(s_in + s_out, d_args.block_size)
    kv_limit = max(d_args.num_blocks // per_request, 1)
    top = min(kv_limit, d_args.max_num_seqs)
    batches = sorted({b for b in DECODE_BATCHES if b <= top} | {top})
    if quick:
        batches = sorted({1, top, max(top // 2, 1)})
    contexts = sorted({min(128, context), context})
    decode = [{"kind": "decode", "batch": b, "context": c, "repeats": 3 if b * c > 50_000 else 7}
              for c in contexts for b in batches
              if b * _blocks(c + 1, d_args.block_size) <= d_args.num_blocks]
    points = {"prefill": prefill, "decode": decode}
    k = d_args.speculative.k
    if d_args.speculative.enabled:          # at k and at 1 (what verifying at all costs a step)
        points["speculative"] = [
            {**p, "num_tokens": j} for j in sorted({1, k}) for p in decode
            if p["batch"] * _blocks(p["context"] + (p["repeats"] + 2) * (j + 1) + 1, d_args.block_size)
            <= d_args.num_blocks] + [{"kind": "acceptance", "num_tokens": k}]
    return points


# ------------------------------------------------------------------ measuring

class Progress:
    """tqdm when installed (and stderr is a terminal or forced), else one updating stderr line."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.done, self.desc, self.enabled = total, 0, desc, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=True, unit="pt")
            except ImportError:
                self._bar = None

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(label)
            self._bar.update(1)
        else:
            print(f"\r{self.desc}: {self.done}/{self.total} {label:<30}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def _label(point: dict) -> str:
    if point["kind"] == "prefill":
        return f"prefill S={point['prompt_len']}" + (" saturated" if point.get("batch") == "saturated" else "")
    if point["kind"] == "acceptance":
        return f"acceptance k={point['num_tokens']}"
    return f"decode B={point['batch']} C={point['context']}" + (f" k={point['num_tokens']}"
                                                                if point.get("num_tokens") else "")


def _runs_on(points: dict, pool: str) -> list[dict]:
    """The points `pool`'s engine measures: its own, and the decode engine the speculative ones."""
    return points[pool] + (points.get("speculative", []) if pool == "decode" else [])


def _assemble(source: str, engines: dict, results: dict) -> dict:
    """The profile of one degree from each pool's engine description and results (in `_runs_on` order)."""
    profile = {"version": PROFILE_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "source": source}
    decode = [r for r in results["decode"] if r is not None]
    steps = [r for r in decode if "seconds" in r]            # (the rest: the acceptance measurement)
    results = {"prefill": [r for r in results["prefill"] if r is not None],
               "decode": [r for r in steps if not r.get("num_tokens")]}
    profile.update({pool: {"engine": engines[pool], "points": results[pool]} for pool in ("prefill", "decode")})
    spec = engines["decode"].get("speculative")
    if spec:
        profile["speculative"] = {**spec, "points": [r for r in steps if r.get("num_tokens")],
                                  "acceptance": next((r for r in decode if "ratio" in r), None)}
    return profile


def degree_config(cfg: PDServeConfig, degree: int) -> PDServeConfig:
    """`cfg` with its prefill and decode pools at tensor-parallel `degree` (such actors keep their role)."""
    if degree == 1:
        return cfg
    at = cfg.model_copy(deep=True)
    at.pools.prefill.tensor_parallel = at.pools.decode.tensor_parallel = degree
    at.routing.role_flips = "off"
    return at


def _local_engine(cfg: PDServeConfig, pool: str, model_dir: str, degree: int):
    """(rank 0's engine here, the follower processes of ranks 1..) of `pool` at `degree`."""
    from engine.local_ranks import start_local_group
    return start_local_group(engine_args(degree_config(cfg, degree), pool, model_dir))


def _check_degrees(degrees: Sequence[int]) -> list[int]:
    if not degrees or 1 not in degrees or any(d < 1 for d in degrees):
        raise ValueError(f"--tp {','.join(map(str, degrees))}: tensor-parallel degrees must be positive and "
                         "include 1 (the planner's base)")
    return sorted(set(degrees))


def profile_local(cfg: PDServeConfig, points: dict | None = None, progress: bool = True,
                  degrees: Sequence[int] = (1,)) -> dict:
    """Measure in-process engines built with each pool's EngineArgs (no Ray), at each of `degrees`."""
    from engine.profile import describe, run_point
    degrees = _check_degrees(degrees)
    model_dir = resolve_model(cfg.model.name)
    points = points or plan_points(cfg, model_dir)
    at_degree = {pool: v for pool, v in points.items() if pool != "speculative"}   # degree 1 alone measures those
    total = sum(len(v) for v in points.values()) + (len(degrees) - 1) * sum(len(v) for v in at_degree.values())
    bar = Progress(total, "profiling (local)", progress)
    measured = {}
    try:
        for degree in degrees:
            engines, results = {}, {}
            for pool in ("prefill", "decode"):
                engine, peers = _local_engine(cfg, pool, model_dir, degree)
                try:
                    engines[pool] = describe(engine)
                    run_point(engine, {"kind": "prefill", "prompt_len": 16})     # warm-up
                    results[pool] = []
                    for point in _runs_on(points if degree == 1 else at_degree, pool):
                        results[pool].append(run_point(engine, point))
                        bar.step(_label(point) + (f" TP {degree}" if degree > 1 else ""))
                finally:
                    engine.close()
                    for peer in peers:
                        peer.join(60)
                del engine
            measured[degree] = _assemble("local", engines, results)
    finally:
        bar.close()
    return {**_with_degrees(measured), "transfer": _link(cfg, model_dir, progress)}


def _with_degrees(measured: dict[int, dict]) -> dict:
    """Degree 1's profile with the other degrees' pools under "degrees" (absent when only degree 1)."""
    profile = measured[1]
    more = {str(d): {pool: p[pool] for pool in ("prefill", "decode")} for d, p in measured.items() if d > 1}
    return {**profile, "degrees": more} if more else profile


def _link(cfg: PDServeConfig, model_dir: str, progress: bool) -> dict:
    from deploy.link_profiler import measure_link
    if progress:
        print(f"profiling the KV link ({cfg.kv_transfer.transport}, {cfg.kv_transfer.compression}, loopback)",
              file=sys.stderr)
    return measure_link(cfg, model_dir)


async def profile_actors(handles: dict, points: dict, progress: bool = True,
                         on_point: Callable[[str, dict], None] | None = None) -> dict:
    """Measure on running actors: handles = {"prefill": actor, "decode": actor}."""
    bar = Progress(sum(len(v) for v in points.values()), "profiling (actors)", progress)
    engines, results = {}, {}
    try:
        for pool in ("prefill", "decode"):
            h = handles[pool]
            engines[pool] = await h.profile.remote({"kind": "describe"})
            await h.profile.remote({"kind": "prefill", "prompt_len": 16})
            results[pool] = []
            for point in _runs_on(points, pool):
                results[pool].append(await h.profile.remote(point))
                bar.step(_label(point))
                if on_point:
                    on_point(pool, point)
    finally:
        bar.close()
    return _assemble("actors", engines, results)


def profile_cluster(cfg: PDServeConfig, points: dict | None = None, progress: bool = True,
                    degrees: Sequence[int] = (1,)) -> dict:
    """Start one actor of each pool (the pools' resources and EngineArgs) on Ray, measure, stop them; at
    each of `degrees` (an actor of degree N is N rank actors in one placement group)."""
    import ray

    from deploy.launcher import ActorFactory, cluster_token, init_ray_for
    degrees = _check_degrees(degrees)

    async def at(degree: int, pts: dict | None) -> tuple[dict, dict]:
        factory = ActorFactory(degree_config(cfg, degree), cluster_token(cfg))
        pts = pts or plan_points(cfg, factory.model_dir)
        run = pts if degree == 1 else {pool: v for pool, v in pts.items() if pool != "speculative"}
        handles = {pool: factory.spawn(pool) for pool in ("prefill", "decode")}
        try:
            await factory.views(list(handles.items()))
            return await profile_actors(handles, run, progress), pts
        finally:
            for h in handles.values():
                ray.kill(h, no_restart=True)
            factory.retire_groups()

    async def main() -> dict:
        init_ray_for(cfg)
        measured, pts = {}, points
        for degree in degrees:
            measured[degree], pts = await at(degree, pts)
        return {**_with_degrees(measured), "transfer": _link(cfg, resolve_model(cfg.model.name), progress)}
    return asyncio.run(main())


# ----------------------------------------------------------- the profile file

def default_profile_path(cfg: PDServeConfig) -> str:
    """The cached profile of this config's pools and workload lengths on this machine."""
    model_dir = resolve_model(cfg.model.name)
    key = {"model": os.path.abspath(model_dir), "dtype": cfg.model.dtype,
           "prefill": str(engine_args(cfg, "prefill", model_dir)), "decode": str(engine_args(cfg, "decode", model_dir)),
           "in": cfg.workload.input_tokens_mean, "out": cfg.workload.output_tokens_mean,
           "host": os.uname().nodename, "version": PROFILE_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = os.path.basename(os.path.normpath(model_dir))
    return os.path.join(cache_root(), "profiles", f"{name}-{digest}.json")


def save_profile(profile: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=1)
    os.replace(tmp, path)
    return path


def load_profile(path: str) -> dict:
    """Read a profile file; ValueError with the path and the key when it is not one (a section of the wrong
    type, a number missing, negative or not finite, a decode or speculative step measured twice)."""
    try:
        with open(path, encoding="utf-8") as f:
            profile = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read profile ({e})") from None
    if not isinstance(profile, dict) or profile.get("version") != PROFILE_VERSION:
        raise ValueError(f"{path}: not a pdserve profile (version {PROFILE_VERSION})")
    for pool in ("prefill", "decode"):
        _check_pool(path, pool, pool, profile.get(pool))
    degrees = profile.get("degrees") or {}
    if not isinstance(degrees, dict):
        raise ValueError(f"{path}: degrees must be a mapping of tensor-parallel degree to pools")
    for degree, pools in degrees.items():
        if not re.fullmatch(r"[1-9][0-9]*", degree) or degree == "1" or not isinstance(pools, dict):
            raise ValueError(f"{path}: degrees.{degree} must be a tensor-parallel degree above 1 mapped to its pools")
        for pool, section in pools.items():
            if pool not in POINT_FIELDS:
                raise ValueError(f"{path}: degrees.{degree}.{pool}: a pool is prefill or decode")
            _check_pool(path, f"degrees.{degree}.{pool}", pool, section)
    _check_speculative(path, profile.get("speculative"))
    calibration = profile.get("calibration", {})
    if not isinstance(calibration, dict):
        raise ValueError(f"{path}: calibration must be a mapping")
    for key, value in calibration.items():
        if key == "send_curve":
            _check_curve(path, f"calibration.{key}", value)
            continue
        least = 0.0 if key.endswith(("_s", "_per_mb")) else None     # fixed costs may be 0; factors must be > 0
        _check_number(path, f"calibration.{key}", value, least)
    transfer = profile.get("transfer", {})
    if not isinstance(transfer, dict):
        raise ValueError(f"{path}: transfer must be a mapping")
    for key in TRANSFER_FIELDS:
        if transfer.get(key) is not None:       # wire_bytes 0: a transport that does not count them (kv_bytes then)
            _check_number(path, f"transfer.{key}", transfer[key], 0.0 if key == "wire_bytes" else None)
    return profile


POINT_FIELDS = {"prefill": ("prompt_len", "seconds"), "decode": ("batch", "context", "seconds", "bytes_per_s")}
"""Each point's required numbers (a prefill point without "batch" is one prompt)."""
TRANSFER_FIELDS = ("kv_bytes", "wire_bytes", "seconds", "kv_bytes_per_s")
"""The link measurement's numbers, where present (a failed measurement has none, and an error)."""


def _check_pool(path: str, key: str, pool: str, section: object) -> None:
    """One pool's measurements at one degree: {"engine": {"costs": ...}, "points": [...]}."""
    if not isinstance(section, dict) or not section.get("points"):
        raise ValueError(f"{path}: no {key} measurements")
    if not isinstance(section.get("engine"), dict) or not isinstance(section["engine"].get("costs"), dict):
        raise ValueError(f"{path}: {key}.engine.costs is missing (the model's shape the points were measured on)")
    try:
        ModelCosts.from_dict(section["engine"]["costs"], f"{key}.engine.costs")
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    points = section["points"]
    _check_points(path, key, points, POINT_FIELDS[pool])
    if pool == "decode":
        _check_distinct(path, f"{key}.points", points, ("batch", "context"))
        return
    # One prompt's time by length rests on the batch-1 points (the saturated steps: batch > 1, or 1 where the
    # token budget takes one prompt, a length measured twice: `MeasuredPerformance` keeps the faster).
    if not any(p.get("batch", 1) == 1 for p in points):
        raise ValueError(f"{path}: {key}.points: no single-prompt point (batch 1), which prefill times rest on")


def _check_distinct(path: str, key: str, points: list[dict], fields: tuple[str, ...]) -> None:
    """No two points at the same `fields` (one step measured twice says two different things)."""
    seen: dict[tuple, int] = {}
    for i, point in enumerate(points):
        at = tuple(point[f] for f in fields)
        if at in seen:
            where = ", ".join(f"{f} {v:g}" for f, v in zip(fields, at))
            raise ValueError(f"{path}: {key}[{i}]: {where} measured twice (also {key}[{seen[at]}])")
        seen[at] = i


def _check_speculative(path: str, spec: object) -> None:
    """{"method", "num_tokens", "adaptive", "points": [...], "acceptance": {ratio, num_tokens, ...} | null}."""
    if spec is None:
        return
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: speculative must be a mapping")
    if spec.get("method") is not None and not isinstance(spec["method"], str):
        raise ValueError(f"{path}: speculative.method must be a method name, got {spec['method']!r}")
    if spec.get("num_tokens") is not None:
        _check_count(path, "speculative.num_tokens", spec["num_tokens"])
    points = spec.get("points") or []
    _check_points(path, "speculative", points, ("batch", "context", "seconds"))
    for i, point in enumerate(points):
        _check_count(path, f"speculative.points[{i}].num_tokens", point.get("num_tokens"))
    _check_distinct(path, "speculative.points", points, ("num_tokens", "batch", "context"))
    acceptance = spec.get("acceptance")
    if acceptance is None:
        return
    if not isinstance(acceptance, dict):
        raise ValueError(f"{path}: speculative.acceptance must be a mapping or null")
    ratio = acceptance.get("ratio")
    if ratio is not None:              # None: nothing was proposed on the held-out text
        _check_number(path, "speculative.acceptance.ratio", ratio, 0.0)
        if ratio > 1:
            raise ValueError(f"{path}: speculative.acceptance.ratio must be at most 1 (accepted / proposed tokens), "
                             f"got {ratio!r}")
    _check_count(path, "speculative.acceptance.num_tokens", acceptance.get("num_tokens"))


def _check_count(path: str, key: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}")


def _check_curve(path: str, key: str, curve: object) -> None:
    """[[wire MB, seconds], ...]: both >= 0, the MB strictly increasing."""
    if not isinstance(curve, list) or not all(isinstance(p, list) and len(p) == 2 for p in curve):
        raise ValueError(f"{path}: {key} must be a list of [wire MB, seconds] pairs")
    for i, (mb, seconds) in enumerate(curve):
        _check_number(path, f"{key}[{i}][0]", mb, 0.0)
        _check_number(path, f"{key}[{i}][1]", seconds, 0.0)
        if i and mb <= curve[i - 1][0]:
            raise ValueError(f"{path}: {key}: the wire MB must increase ({curve[i - 1][0]} then {mb})")


def _check_points(path: str, pool: str, points: object, fields: tuple[str, ...]) -> None:
    """Each point a mapping with `fields` (and "batch" where present) finite numbers above 0 ("context": 0 too)."""
    if not isinstance(points, list):
        raise ValueError(f"{path}: {pool}.points must be a list")
    for i, point in enumerate(points):
        if not isinstance(point, dict):
            raise ValueError(f"{path}: {pool}.points[{i}] must be a mapping")
        for field in fields:
            _check_number(path, f"{pool}.points[{i}].{field}", point.get(field), 0.0 if field == "context" else None)
        if "batch" in point and "batch" not in fields:
            _check_number(path, f"{pool}.points[{i}].batch", point["batch"], None)


def _check_number(path: str, key: str, value: object, least: float | None) -> None:
    """A finite number above 0 (at least `least` when given); ValueError naming `key` otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value < least if least is not None else value <= 0):
        bound = f"at least {least:g}" if least is not None else "above 0"
        raise ValueError(f"{path}: {key} must be a finite number {bound}, got {value!r}")
