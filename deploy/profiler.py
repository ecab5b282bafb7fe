"""Profile the pools on this hardware: the measured points behind `engine.performance.MeasuredPerformance`.

Measuring: prefill FLOP/s vs prompt length, decode step time vs batch size and context length
(→ bytes/s), and the KV link: one prompt's KV through the configured transport and codec
(`deploy.link_profiler`, on this host's loopback). The engine measurements run on the actual
pool actors (`ServingActor.profile`, one point per call so progress shows) or, with `local=True`, on
in-process engines built from the same `EngineArgs`; `engine.profile` takes each point and
`engine.cost_model` counts its FLOPs and bytes.

Reading: `engine.performance.MeasuredPerformance` interpolates the points (prefill seconds(S), decode
step seconds(B, C), the link's bytes/s): the performance model the planner, the autoscaler and auto
placement ask (`deploy.performance` picks the one a cluster starts from).

A profile is a JSON file:

    {"version": 1, "created": ..., "source": "actors" | "local",
     "prefill": {"engine": {...costs, threads, chunk_size...},
                 "points": [{prompt_len, batch, seconds, flops, flops_per_s}]},
     "decode":  {"engine": {...}, "points": [{batch, context, seconds, bytes, bytes_per_s, flops}]},
     "transfer": {transport, codec, kv_bytes, wire_bytes, seconds, kv_bytes_per_s} (or {..., error}),
     "calibration": {"prefill": factor, "decode": factor}}      (optional, bench.serving.plan_check)

`default_profile_path(cfg)` names the cached profile of a config (model, dtype, threads,
KV budget, batch limits and workload lengths): `pdserve plan` reuses it, or profiles first.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable

from deploy.config import PDServeConfig
from deploy.launcher import engine_args
from engine.model.presets import cache_root, resolve_model

PROFILE_VERSION = 1
PREFILL_LENS = (128, 512)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


# ------------------------------------------------------------ what to measure

def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_points(cfg: PDServeConfig, model_dir: str, quick: bool = False) -> dict[str, list[dict]]:
    """The measurements a plan for `cfg` needs, per pool.

    Prefill: one prompt at a few reference lengths and at the workload's mean (the TTFT
    side), and a saturated step of mean-length prompts (the throughput side). Decode: batch
    sizes up to what the KV budget and `max_batch_size` allow, at the workload's mean
    context (prompt + half the output) and at a short one. Each point keeps its best of
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
    return {"prefill": prefill, "decode": decode}


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
    return f"decode B={point['batch']} C={point['context']}"


def _assemble(source: str, engines: dict, results: dict) -> dict:
    return {"version": PROFILE_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source": source,
            **{pool: {"engine": engines[pool], "points": [r for r in results[pool] if r is not None]}
               for pool in ("prefill", "decode")}}


def profile_local(cfg: PDServeConfig, points: dict | None = None, progress: bool = True) -> dict:
    """Measure in-process engines built with each pool's EngineArgs (no Ray)."""
    from engine import Engine
    from engine.profile import describe, run_point
    model_dir = resolve_model(cfg.model.name)
    points = points or plan_points(cfg, model_dir)
    bar = Progress(sum(len(v) for v in points.values()), "profiling (local)", progress)
    engines, results = {}, {}
    try:
        for pool in ("prefill", "decode"):
            engine = Engine(engine_args(cfg, pool, model_dir))
            engines[pool] = describe(engine)
            run_point(engine, {"kind": "prefill", "prompt_len": 16})     # warm-up
            results[pool] = []
            for point in points[pool]:
                results[pool].append(run_point(engine, point))
                bar.step(_label(point))
            del engine
    finally:
        bar.close()
    return {**_assemble("local", engines, results), "transfer": _link(cfg, model_dir, progress)}


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
            for point in points[pool]:
                results[pool].append(await h.profile.remote(point))
                bar.step(_label(point))
                if on_point:
                    on_point(pool, point)
    finally:
        bar.close()
    return _assemble("actors", engines, results)


def profile_cluster(cfg: PDServeConfig, points: dict | None = None, progress: bool = True) -> dict:
    """Start one actor of each pool (the pools' resources and EngineArgs) on Ray, measure, stop them."""
    import ray

    from deploy.launcher import ActorFactory, cluster_token, init_ray_for

    async def main() -> dict:
        init_ray_for(cfg)
        factory = ActorFactory(cfg, cluster_token(cfg))
        pts = points or plan_points(cfg, factory.model_dir)
        handles = {pool: factory.spawn(pool) for pool in ("prefill", "decode")}
        try:
            await factory.views(list(handles.items()))
            profile = await profile_actors(handles, pts, progress)
            return {**profile, "transfer": _link(cfg, factory.model_dir, progress)}
        finally:
            for h in handles.values():
                ray.kill(h, no_restart=True)
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
    """Read a profile file; ValueError with the path when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            profile = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read profile ({e})") from None
    if not isinstance(profile, dict) or profile.get("version") != PROFILE_VERSION:
        raise ValueError(f"{path}: not a pdserve profile (version {PROFILE_VERSION})")
    for pool in ("prefill", "decode"):
        if not profile.get(pool, {}).get("points"):
            raise ValueError(f"{path}: no {pool} measurements")
    return profile
