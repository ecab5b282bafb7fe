"""`pdserve plan` over a simulator's time model: the planner reads a profile, so write one from the model.

The profile has the points `pdserve profile` would have measured on that hardware — one prompt's
prefill at a few lengths and the decode step over batch and context — computed by the time model,
so the planner's split and the simulated best split come from the same seconds. For the planner's
search over tensor-parallel degrees (`search_with_model`) it also holds those points at each degree.
"""
from __future__ import annotations

from bench.serving.workloads import RequestSpec
from bench.simulate.measured import MeasuredModel
from bench.simulate.step_time import Chunk, StepTimeModel, sim_args
from deploy.launcher import engine_args
from deploy.plan_cli import ParallelismSearch
from deploy.planner import SLO, Limits, Network, Parallelism, Plan, Workload, plan, search_parallelism
from deploy.profiler import DECODE_BATCHES, PROFILE_VERSION
from engine.cost_model import ModelCosts
from engine.model.config import ModelConfig
from engine.performance import MeasuredPerformance, PerformanceModel, Speculation

PREFILL_POINTS = (128, 512, 1024, 2048, 4096, 8192)


def profile_of(model: StepTimeModel, shape: ModelConfig, contexts: tuple[int, ...],
               degrees: tuple[int, ...] = (), speculation: Speculation | None = None) -> dict:
    """A profile (deploy.profiler's format) whose points are the model's seconds; with `degrees`, also both
    pools' points at each of those tensor-parallel degrees (the `"degrees"` section `pdserve profile --tp`
    writes), from `model.at_degree`; with `speculation`, the speculative steps at 1 and k proposals per
    sequence (`"speculative"`, as `pdserve profile` measures them), the proposing included."""
    dtype_bytes = max(round(model.kv_bytes_per_token / max(shape.kv_bytes_per_token(1), 1)), 1)
    costs = ModelCosts.of(shape, dtype_bytes)
    engine = {"costs": costs.to_dict()}
    probe = 1 << 26
    profile = {"version": PROFILE_VERSION, "source": f"simulated ({model.name})",
               "prefill": {"engine": engine, "points": _prefill_points(model, shape, costs)},
               "decode": {"engine": engine, "points": _decode_points(model, costs, contexts)},
               "transfer": {"kv_bytes": probe, "wire_bytes": probe, "seconds": model.link_s(probe),
                            "kv_bytes_per_s": probe / model.link_s(probe)}}
    if speculation is not None:
        spec_model = model.with_speculation(speculation)
        profile["speculative"] = {"method": speculation.method, "num_tokens": speculation.num_tokens,
                                  "adaptive": speculation.adaptive, "acceptance": None,
                                  "points": _spec_points(spec_model, costs, contexts, speculation.num_tokens)}
    above = [d for d in degrees if d > 1]
    if above:
        profile["degrees"] = {str(d): {
            "prefill": {"engine": engine, "points": _prefill_points(model.at_degree("prefill", d), shape, costs)},
            "decode": {"engine": engine, "points": _decode_points(model.at_degree("decode", d), costs, contexts)}}
            for d in above}
    return profile


def _prefill_points(model: StepTimeModel, shape: ModelConfig, costs: ModelCosts) -> list[dict]:
    lens = [s for s in PREFILL_POINTS if s <= shape.max_position_embeddings] or [shape.max_position_embeddings]
    prefill = [{"prompt_len": s, "batch": 1, "seconds": model.step_s([Chunk(s, s)]),
                "flops": costs.prefill_flops(s)} for s in lens]
    for p in prefill:
        p["flops_per_s"] = p["flops"] / p["seconds"]
    return prefill


def _decode_points(model: StepTimeModel, costs: ModelCosts, contexts: tuple[int, ...]) -> list[dict]:
    decode = []
    for c in sorted(set(contexts)):
        for b in DECODE_BATCHES:
            seconds = model.step_s([Chunk(1, c)] * b)
            nbytes = costs.decode_bytes(b, c)
            decode.append({"batch": b, "context": c, "seconds": seconds, "bytes": nbytes,
                           "bytes_per_s": nbytes / seconds, "flops": costs.decode_flops(b, c)})
    return decode


def _spec_points(model: StepTimeModel, costs: ModelCosts, contexts: tuple[int, ...], k: int) -> list[dict]:
    """The decode points again with exactly 1 and exactly k proposals per sequence."""
    return [{"batch": b, "context": c, "num_tokens": j, "seconds": model.step_s([Chunk(1 + j, c + j, j)] * b),
             "flops": costs.decode_flops(b * (1 + j), c)}
            for j in sorted({1, k}) for c in sorted(set(contexts)) for b in DECODE_BATCHES]


def performance_of(model: StepTimeModel, shape: ModelConfig, cfg,
                   speculation: Speculation | None = None) -> PerformanceModel:
    """The performance model the simulated router and autoscaler ask: the measured profile of a `MeasuredModel`,
    else a profile written from the time model at the config's workload context; with the decode actors'
    `speculation`, as `deploy.performance.base_model` gives a real router its own."""
    if isinstance(model, MeasuredModel):
        return MeasuredPerformance(model.profile.data, speculation)
    w = cfg.workload
    contexts = (128, round(w.input_tokens_mean + w.output_tokens_mean / 2))
    return MeasuredPerformance(profile_of(model, shape, contexts, speculation=speculation), speculation)


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


def usable_degrees(model: StepTimeModel, degrees: tuple[int, ...], block_size: int) -> tuple[list[int], dict]:
    """(the degrees an actor of either pool can run at, {degree: why not} for the rest): the engine must split
    the heads and a measured profile must have both pools' points there (`at_degree`), and a hardware model
    must fit a rank's weights with room for KV blocks."""
    usable, refused = [], {}
    for d in degrees:
        try:
            model.at_degree("prefill", d)
            blocks = model.at_degree("decode", d).kv_blocks(block_size)
        except ValueError as e:
            refused[d] = str(e)
            continue
        if blocks == 0:
            refused[d] = "no room for a KV block after the weights"
        else:
            usable.append(d)
    return usable, refused


def search_with_model(cfg, model: StepTimeModel, shape: ModelConfig, specs: list[RequestSpec], slo_ttft_s: float,
                      slo_tpot_s: float, search: ParallelismSearch,
                      speculation: Speculation | None = None) -> list[Parallelism]:
    """`pdserve plan --devices N --tp …`'s search (`deploy.planner.search_parallelism`) over `model`'s seconds:
    the profile holds the model's points at every degree searched, so the planner's `DegreeModel` reads them
    rather than predicting; a decode actor's KV budget at each degree is the model's (`kv_blocks`: each rank's
    memory after its share of the weights). The link is one rank's (the degree-1 handoff's); the search moves
    a handoff over the fewer ranks' links of its two pools at once, as the simulator's `PoolModels` does.
    With the decode actors' `speculation`, the planner prices their decode step as
    `pdserve plan` does (`PerformanceModel.token_seconds`), from the model's speculative steps."""
    s_in = sum(s.prompt_len for s in specs) / len(specs)
    s_out = sum(s.output_len for s in specs) / len(specs)
    block_size = cfg.pool_kv_cache("decode").block_size
    degrees, _ = usable_degrees(model, search.degrees, block_size)
    if not degrees:
        return []
    profile = MeasuredPerformance(profile_of(model, shape, (128, round(s_in + s_out / 2)), tuple(degrees),
                                             speculation), speculation)
    blocks = {d: model.at_degree("decode", d).kv_blocks(block_size) for d in degrees}
    configured = engine_args(cfg, "decode", cfg.model.name, shape).num_blocks     # (a budget the config sets)
    limits = Limits(configured, block_size, cfg.pools.decode.max_batch_size)
    network = Network(profile.transfer["kv_bytes_per_s"], model.name)
    return search_parallelism(profile, Workload(s_in, s_out, 1.0), SLO(slo_ttft_s, slo_tpot_s), limits,
                              search.devices, degrees, search.allreduce(), network,
                              {d: b for d, b in blocks.items() if b is not None})
