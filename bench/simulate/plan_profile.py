"""`pdserve plan` over a simulator's time model: the planner reads a profile, so write one from the model.

The profile has the points `pdserve profile` would have measured on that hardware — one prompt's
prefill at a few lengths and the decode step over batch and context — computed by the time model,
so the planner's split and the simulated best split come from the same seconds.
"""
from __future__ import annotations

from bench.serving.workloads import RequestSpec
from bench.simulate.measured import MeasuredModel
from bench.simulate.step_time import Chunk, StepTimeModel, sim_args
from deploy.launcher import engine_args
from deploy.planner import SLO, Limits, Network, Plan, Workload, plan
from deploy.profiler import DECODE_BATCHES, PROFILE_VERSION
from engine.cost_model import ModelCosts
from engine.model.config import ModelConfig
from engine.performance import MeasuredPerformance, PerformanceModel

PREFILL_POINTS = (128, 512, 1024, 2048, 4096, 8192)


def profile_of(model: StepTimeModel, shape: ModelConfig, contexts: tuple[int, ...]) -> dict:
    """A profile (deploy.profiler's format) whose points are the model's seconds."""
    dtype_bytes = max(round(model.kv_bytes_per_token / max(shape.kv_bytes_per_token(1), 1)), 1)
    costs = ModelCosts.of(shape, dtype_bytes)
    lens = [s for s in PREFILL_POINTS if s <= shape.max_position_embeddings] or [shape.max_position_embeddings]
    prefill = [{"prompt_len": s, "batch": 1, "seconds": model.step_s([Chunk(s, s)]),
                "flops": costs.prefill_flops(s)} for s in lens]
    for p in prefill:
        p["flops_per_s"] = p["flops"] / p["seconds"]
    decode = []
    for c in sorted(set(contexts)):
        for b in DECODE_BATCHES:
            seconds = model.step_s([Chunk(1, c)] * b)
            nbytes = costs.decode_bytes(b, c)
            decode.append({"batch": b, "context": c, "seconds": seconds, "bytes": nbytes,
                           "bytes_per_s": nbytes / seconds, "flops": costs.decode_flops(b, c)})
    probe = 1 << 26
    engine = {"costs": costs.to_dict()}
    return {"version": PROFILE_VERSION, "source": f"simulated ({model.name})",
            "prefill": {"engine": engine, "points": prefill}, "decode": {"engine": engine, "points": decode},
            "transfer": {"kv_bytes": probe, "wire_bytes": probe, "seconds": model.link_s(probe),
                         "kv_bytes_per_s": probe / model.link_s(probe)}}


def performance_of(model: StepTimeModel, shape: ModelConfig, cfg) -> PerformanceModel:
    """The performance model the simulated router and autoscaler ask: the measured profile of a `MeasuredModel`,
    else a profile written from the time model at the config's workload context."""
    if isinstance(model, MeasuredModel):
        return model.profile
    w = cfg.workload
    return MeasuredPerformance(profile_of(model, shape, (128, round(w.input_tokens_mean + w.output_tokens_mean / 2))))


def plan_with_model(cfg, model: StepTimeModel, shape: ModelConfig, specs: list[RequestSpec], rate: float,
                    slo_ttft_s: float, slo_tpot_s: float) -> Plan:
    """The planner's pools for `specs`' mean lengths at `rate` and these SLOs, from `model`'s seconds (pool
    sizes unbounded: the question is which split, not what the config allows)."""
    s_in = sum(s.prompt_len for s in specs) / len(specs)
    s_out = sum(s.output_len for s in specs) / len(specs)
    profile = MeasuredPerformance(profile_of(model, shape, (128, round(s_in + s_out / 2))))
    args = sim_args(engine_args(cfg, "decode", cfg.model.name, shape), model)
    limits = Limits(args.num_blocks, args.block_size, cfg.pools.decode.max_batch_size)
    link = profile.transfer["kv_bytes_per_s"]
    return plan(profile, Workload(s_in, s_out, rate), SLO(slo_ttft_s, slo_tpot_s), limits,
                network=Network(link, model.name))
