"""Pool sizing from the performance model (`engine.performance`): pure functions, no I/O.

    decode:  B* = the largest batch whose time per output token at the workload's mean
             context (prompt + output/2) meets the TPOT SLO, within max_batch_size and
             the KV budget (each request reserves prompt + max_tokens of blocks); the time per
             token is the measured step's, or with speculative decoding the step the engine would
             run at that batch over the tokens it yields per sequence (`token_seconds`);
             tokens/s per actor = B* / token time(B*); n_decode = rate · out / (util · that).
    prefill: t_p = measured time of one prompt of the mean length (chunked as served);
             capacity = prompt tokens/s of a saturated step (as many mean-length prompts
             as the token budget takes); the TTFT SLO caps the utilization ρ so that
             t_p + p99 queueing wait (M/M/1: ln(100ρ)·t_p/(1−ρ)) ≤ TTFT;
             n_prefill = rate · S / (ρ · capacity).
    network: the prompt's KV crosses from prefill to decode: bytes = S · KV bytes per token;
             the link (measured by `pdserve profile` with the configured transport and codec, or
             `kv_transfer.link_gbps`) carries at most link KV bytes/s ÷ bytes requests per second.
             The planned pools serve min(prefill, decode, link) req/s; the plan says which binds,
             and when it is the link, that more actors will not help.
Counts follow from the measurements and the workload; no ratio is assumed. `pdserve plan` asks the
measured profile; the autoscaler asks the router's live model (the same profile, corrected by what
the cluster reports) with observed lengths and rate, and correction factors (measured / predicted
TTFT and TPOT) that scale the predicted times.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from engine.performance import DecodeStep, PerformanceModel


@dataclass(slots=True, frozen=True)
class Workload:
    input_tokens: float
    output_tokens: float
    arrival_rate_rps: float


@dataclass(slots=True, frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float


@dataclass(slots=True, frozen=True)
class Limits:
    """What the config allows: decode KV blocks and batch size, and each pool's count bounds."""
    decode_kv_blocks: int
    block_size: int
    max_batch_size: int
    prefill_bounds: tuple[int, int] = (1, 1 << 30)
    decode_bounds: tuple[int, int] = (1, 1 << 30)


@dataclass(slots=True, frozen=True)
class Corrections:
    """measured / predicted, from live traffic (1.0 = trust the profile)."""
    ttft: float = 1.0
    tpot: float = 1.0


@dataclass(slots=True, frozen=True)
class Network:
    """The KV link between the pools: what the network term divides by.

    kv_bytes_per_s: model-dtype KV bytes the transfers move per second, codec included (a measured
        transfer's KV bytes ÷ its time, or a link's bytes/s × the codec's KV bytes per wire byte).
    source: where the figure comes from, for the plan's reasoning.
    """
    kv_bytes_per_s: float
    source: str


def ranks_network(network: Network | None, ranks: int) -> Network | None:
    """`network`, one rank's link, as `ranks` ranks' links moving their shares of a handoff at once."""
    if network is None or ranks == 1:
        return network
    return Network(network.kv_bytes_per_s * ranks, f"{network.source}, over {ranks} ranks' links")


def link_kv_bytes_per_s(link_gbps: float, wire_bytes_per_kv_byte: float) -> float:
    """KV bytes/s through a link of ``link_gbps`` Gbit/s when each KV byte costs that many wire bytes."""
    return link_gbps * 1e9 / 8 / wire_bytes_per_kv_byte


@dataclass(slots=True)
class Plan:
    workload: dict
    slo: dict
    ledger: dict
    decode: dict
    prefill: dict
    n_prefill: int
    n_decode: int
    needed_prefill: float
    needed_decode: float
    reasons: list[str] = field(default_factory=list)
    network: dict = field(default_factory=dict)      # the network term, empty without a link figure
    rate_bounds: dict = field(default_factory=dict)  # req/s the planned pools (and the link) can carry

    @property
    def ratio(self) -> float:
        """prefill : decode actors, unrounded (what the workload needs)."""
        return self.needed_prefill / self.needed_decode if self.needed_decode else math.inf

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


def p99_ttft(service_s: float, utilization: float) -> float:
    """Service time + p99 wait of an M/M/1 queue at `utilization` (a conservative bound)."""
    if utilization <= 0.01:
        return service_s
    if utilization >= 1:
        return math.inf
    return service_s + math.log(100 * utilization) * service_s / (1 - utilization)


def max_utilization(service_s: float, ttft_slo_s: float) -> float:
    """Largest utilization whose p99 TTFT meets the SLO (0 when one prompt alone misses it)."""
    if service_s > ttft_slo_s:
        return 0.0
    lo, hi = 0.01, 0.999
    if p99_ttft(service_s, hi) <= ttft_slo_s:
        return hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p99_ttft(service_s, mid) <= ttft_slo_s else (lo, mid)
    return lo


def decode_batch(model: PerformanceModel, context: float, slo_s: float, kv_limit: int, max_batch: int,
                 tpot_correction: float = 1.0) -> tuple[int, bool]:
    """(largest batch whose time per output token meets the TPOT SLO within the limits, whether B=1 meets it)."""
    top = max(min(kv_limit, max_batch), 1)
    best = 0
    for b in range(1, top + 1):
        if model.token_seconds(b, context) * tpot_correction <= slo_s:
            best = b
    return max(best, 1), best > 0


def _clamp(n: int, bounds: tuple[int, int]) -> int:
    return min(max(n, bounds[0]), bounds[1])


def plan(model: PerformanceModel, workload: Workload, slo: SLO, limits: Limits,
         corrections: Corrections = Corrections(), decode_utilization: float = 0.9,
         min_prefill_utilization: float = 0.5, network: Network | None = None) -> Plan:
    """Size the pools with `model`'s times (it must rest on a measured profile: the ledger reads its costs
    and peaks). Args:
        decode_utilization: share of a decode actor's token rate the plan may use (headroom for bursts).
        min_prefill_utilization: the plan never runs prefill actors below this utilization; when the
            TTFT SLO would need less (or one prompt alone misses it) the SLO is reported as not met.
        network: the KV link's figure; None leaves the network term out (and says so).
    """
    s_in, s_out, rate = workload.input_tokens, workload.output_tokens, workload.arrival_rate_rps
    profile = model.measured
    if profile is None:
        raise ValueError("planning needs a measured profile (pdserve profile)")
    costs = profile.costs
    reasons: list[str] = []
    cal = profile.calibration
    if cal:                 # (the profile's times include the factors)
        reasons.append("profile calibrated on the running cluster: serving takes " + ", ".join(
            f"{v:.2f}× the profiled {k} time" for k, v in cal.items()))
    context = s_in + s_out / 2
    per_request_blocks = math.ceil((s_in + s_out) / limits.block_size)
    kv_limit = limits.decode_kv_blocks // per_request_blocks
    if kv_limit < 1:
        reasons.append(f"KV budget: one request needs {per_request_blocks} blocks, a decode actor has "
                       f"{limits.decode_kv_blocks}: requests of this length cannot be served")
    batch, tpot_ok = decode_batch(model, context, slo.tpot_s, max(kv_limit, 1), limits.max_batch_size,
                                  corrections.tpot)
    step_s = model.decode_step_seconds(batch, context) * corrections.tpot
    decode_step = model.decode_step(batch, context)
    token_s = decode_step.token_s * corrections.tpot
    decode_tps = batch / token_s
    binding = ("TPOT SLO" if batch < min(kv_limit, limits.max_batch_size) else
               "KV budget" if kv_limit <= limits.max_batch_size else "max_batch_size")
    reasons.append(f"decode batch {batch} (limits: KV budget {kv_limit}, max_batch_size "
                   f"{limits.max_batch_size}, TPOT SLO {slo.tpot_s * 1e3:.0f} ms → bound by {binding}); "
                   f"step {step_s * 1e3:.1f} ms at context {context:.0f}"
                   + (f", {token_s * 1e3:.1f} ms per token with speculation" if model.speculation is not None else "")
                   + f" → {decode_tps:.1f} tokens/s per actor")
    speculation = _speculation_term(model, decode_step, batch, step_s, token_s, reasons)
    if not tpot_ok:
        reasons.append(f"TPOT SLO unreachable: one sequence alone takes {token_s * 1e3:.1f} ms per token")
    needed_decode = rate * s_out / (decode_utilization * decode_tps)
    reasons.append(f"decode demand {rate * s_out:.1f} tokens/s ÷ ({decode_utilization:.0%} × {decode_tps:.1f}) "
                   f"= {needed_decode:.2f} actors")

    prefill_s = model.prefill_seconds(s_in) * corrections.ttft
    capacity = model.prefill_capacity(s_in) / corrections.ttft
    util = max_utilization(prefill_s, slo.ttft_s)
    ttft_ok = util >= min_prefill_utilization
    if util == 0:
        reasons.append(f"TTFT SLO unreachable: one {s_in:.0f}-token prompt takes {prefill_s:.2f} s > "
                       f"{slo.ttft_s:.2f} s; sized for throughput at {min_prefill_utilization:.0%} utilization")
    elif not ttft_ok:
        reasons.append(f"TTFT SLO not met at a useful load: it allows only {util:.0%} utilization "
                       f"(one prompt takes {prefill_s * 1e3:.0f} ms of {slo.ttft_s * 1e3:.0f} ms); sized at "
                       f"{min_prefill_utilization:.0%}, predicted p99 TTFT "
                       f"{p99_ttft(prefill_s, min_prefill_utilization) * 1e3:.0f} ms")
    util = max(util, min_prefill_utilization)
    prefill_tps = capacity * util
    needed_prefill = rate * s_in / prefill_tps
    reasons.append(f"prefill {prefill_s * 1e3:.0f} ms per {s_in:.0f}-token prompt → capacity {capacity:.0f} "
                   f"tokens/s; TTFT SLO allows {util:.0%} utilization → {prefill_tps:.0f} tokens/s per actor; "
                   f"demand {rate * s_in:.0f} tokens/s → {needed_prefill:.2f} actors")
    n_prefill = _clamp(max(math.ceil(needed_prefill - 1e-9), 1), limits.prefill_bounds)
    n_decode = _clamp(max(math.ceil(needed_decode - 1e-9), 1), limits.decode_bounds)
    for name, need, n, bounds in (("prefill", needed_prefill, n_prefill, limits.prefill_bounds),
                                  ("decode", needed_decode, n_decode, limits.decode_bounds)):
        if math.ceil(need - 1e-9) > bounds[1]:
            reasons.append(f"{name}: needs {math.ceil(need)} actors but max is {bounds[1]}")

    bounds = {"prefill": n_prefill * prefill_tps / s_in,
              "decode": n_decode * decode_utilization * decode_tps / s_out}
    net = _network_term(network, s_in * costs.kv_bytes_per_token, rate, bounds, reasons)

    flops_prefill = profile.prefill_costs.prefill_flops(round(s_in))
    prefill_bytes = costs.weight_bytes + s_in * costs.kv_bytes_per_token
    step_bytes = costs.decode_bytes(batch, context)
    step_flops = costs.decode_flops(batch, context)
    balance = profile.peak_flops_per_s / profile.peak_bytes_per_s
    ledger = {
        "prefill_flops_per_request": flops_prefill,
        "prefill_seconds_per_request": prefill_s,
        "prefill_flops_per_s": flops_prefill / prefill_s,
        "prefill_arithmetic_intensity": flops_prefill / prefill_bytes,
        "decode_context_mean": context,
        "decode_bytes_per_step": step_bytes,
        "decode_weight_bytes": float(costs.weight_bytes),
        "decode_theoretical_step_s": step_bytes / profile.peak_bytes_per_s,
        "decode_measured_step_s": step_s,
        "decode_bytes_per_s": step_bytes / step_s,
        "decode_arithmetic_intensity": step_flops / step_bytes,
        "kv_bytes_per_token": costs.kv_bytes_per_token,
        "kv_bytes_per_request": (s_in + s_out) * costs.kv_bytes_per_token,
        "peak_flops_per_s": profile.peak_flops_per_s,
        "peak_bytes_per_s": profile.peak_bytes_per_s,
        "machine_balance_flops_per_byte": balance,
    }
    decode = {"batch": batch, "kv_limit": kv_limit, "max_batch_size": limits.max_batch_size, "step_s": step_s,
              "token_s": token_s, "tokens_per_s_per_actor": decode_tps, "tpot_slo_met": tpot_ok,
              "utilization": decode_utilization, "speculation": speculation}
    prefill = {"seconds_per_request": prefill_s, "capacity_tokens_per_s": capacity, "utilization": util,
               "tokens_per_s_per_actor": prefill_tps, "predicted_p99_ttft_s": p99_ttft(prefill_s, util),
               "ttft_slo_met": ttft_ok}
    return Plan({"input_tokens": s_in, "output_tokens": s_out, "arrival_rate_rps": rate},
                {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, ledger, decode, prefill,
                n_prefill, n_decode, needed_prefill, needed_decode, reasons, net, bounds)


def _speculation_term(model: PerformanceModel, step: DecodeStep, batch: int, plain_s: float, token_s: float,
                      reasons: list[str]) -> dict:
    """What speculative decoding does to the decode step at the planned batch (the plan's ``decode.speculation``,
    {} when it is off), with a line of reasons."""
    spec = model.speculation
    if spec is None:
        return {}
    if not spec.acceptance:
        reasons.append(f"speculative decoding ({spec.method}, k {spec.num_tokens}): no acceptance figure (pdserve "
                       "plan --spec-acceptance, or a profile that measured it), so no speed-up is counted")
    elif step.num_tokens == 0:
        reasons.append(f"speculative decoding ({spec.method}, k {spec.num_tokens}, acceptance {spec.acceptance:.2f}): "
                       f"at batch {batch} proposing loses, so the engine turns it down to k 0 and no speed-up is "
                       "counted")
    else:
        reasons.append(f"speculative decoding ({spec.method}, acceptance {spec.acceptance:.2f}): at batch {batch} "
                       f"the engine verifies k {step.num_tokens} → {step.tokens_per_step:.2f} tokens per "
                       f"{token_s * step.tokens_per_step * 1e3:.1f} ms step = {token_s * 1e3:.1f} ms per token "
                       f"(a plain step: {plain_s * 1e3:.1f} ms)")
    return {"method": spec.method, "num_tokens": spec.num_tokens, "acceptance": spec.acceptance,
            "adaptive": spec.adaptive, "step_num_tokens": step.num_tokens, "tokens_per_step": step.tokens_per_step,
            "verify_step_s": token_s * step.tokens_per_step}


def _network_term(network: Network | None, kv_bytes: float, rate: float, bounds: dict, reasons: list[str]) -> dict:
    """KV bytes per request ÷ the link's KV bytes/s; adds the link to ``bounds`` and says which bound binds."""
    if network is None or network.kv_bytes_per_s <= 0:
        reasons.append("network term left out: the profile has no transfer measurement for this transport and "
                       "codec, and kv_transfer.link_gbps is not set")
        binding = min(bounds, key=bounds.get)
        reasons.append(f"the planned pools carry at most {bounds[binding]:.2f} req/s, bound by {binding}")
        return {}
    seconds = kv_bytes / network.kv_bytes_per_s
    bounds["link"] = network.kv_bytes_per_s / kv_bytes
    binding = min(bounds, key=bounds.get)
    reasons.append(f"network: {kv_bytes / 1e6:.2f} MB of prompt KV per request ÷ {network.kv_bytes_per_s / 1e9:.3f} "
                   f"GB/s ({network.source}) = {seconds * 1e3:.1f} ms per handoff → the link carries at most "
                   f"{bounds['link']:.2f} req/s")
    if binding == "link":
        reasons.append(f"the link, not prefill or decode, bounds the request rate: {bounds['link']:.2f} req/s "
                       f"(the planned pools: prefill {bounds['prefill']:.2f}, decode {bounds['decode']:.2f} req/s); "
                       "more actors will not raise it; a faster link or transport (or codec fp8 over none) will")
    else:
        reasons.append(f"the planned pools carry at most {bounds[binding]:.2f} req/s, bound by {binding} "
                       f"(link {bounds['link']:.2f} req/s)")
    if bounds["link"] < rate:
        reasons.append(f"the workload's {rate:g} req/s exceeds what the link carries ({bounds['link']:.2f} req/s)")
    return {"source": network.source, "kv_bytes_per_request": kv_bytes, "kv_bytes_per_s": network.kv_bytes_per_s,
            "seconds_per_request": seconds, "max_rate_rps": bounds["link"], "binding": binding}


def inputs_from_config(cfg, decode_kv_blocks: int) -> tuple[Workload, SLO, Limits]:
    """The plan's inputs from a PDServeConfig (duck-typed: the planner stays pure)."""
    w, s, pools = cfg.workload, cfg.slo, cfg.pools
    workload = Workload(w.input_tokens_mean, w.output_tokens_mean, w.arrival_rate_rps)
    slo = SLO(s.ttft_p99_ms / 1e3, s.tpot_p99_ms / 1e3)
    limits = Limits(decode_kv_blocks, cfg.pool_kv_cache("decode").block_size, pools.decode.max_batch_size,
                    pools.prefill.bounds(), pools.decode.bounds())
    return workload, slo, limits


def tp_speedup(step_s: float, degree: float, collective_s: float) -> float:
    """Predicted speed-up of a step at tensor-parallel `degree` over one rank: the step's compute splits
    evenly over the ranks (`step_s` / degree: every projection and the attention are sharded by heads) and
    the ranks then pay `collective_s` per step in all-reduces (two per layer, not hidden behind compute);
    the replicated embedding and LM head are counted as split, a small optimism for small models."""
    return step_s / (step_s / degree + collective_s)


# ---- parallelism per pool: DistServe's search over (TP_p, n_p, TP_d, n_d) --------------------------
@dataclass(slots=True, frozen=True)
class AllReduce:
    """What one all-reduce of `n` bytes costs among the ranks of a degree: `latency_s + n / bytes_per_s`.
    A tensor-parallel step runs two per layer (attention and MLP outputs) of tokens × hidden values."""
    latency_s: float
    bytes_per_s: float


class DegreeModel(PerformanceModel):
    """A `PerformanceModel` at tensor-parallel degrees (prefill `prefill_degree`, decode `decode_degree`).
    Where the profile measured a pool at its degree (`MeasuredPerformance.at_degree`) those points give its
    times; otherwise they are predicted from the degree-1 measurements: a step's compute splits over the
    ranks and each step adds its all-reduces (`tp_speedup`'s model). A decode actor's ranks hold
    `decode_degree` times the KV blocks. Speculation is the base's; a speculative step at a degree the
    profile did not measure is predicted from degree 1's the same way."""

    def __init__(self, base: PerformanceModel, prefill_degree: int, decode_degree: int,
                 allreduce: dict[int, AllReduce]):
        self.base, self.prefill_degree, self.decode_degree, self.allreduce = base, prefill_degree, decode_degree, \
            allreduce
        costs = base.measured.costs
        self.num_layers, self.value_bytes = costs.num_layers, costs.hidden_size * costs.dtype_bytes
        self.prefill_measured = base.measured.at_degree("prefill", prefill_degree) if prefill_degree > 1 else None
        self.decode_measured = base.measured.at_degree("decode", decode_degree) if decode_degree > 1 else None
        self.speculation = base.speculation
        self.kv_bytes_per_token = base.kv_bytes_per_token

    @property
    def measured(self):
        return self.base.measured

    @property
    def kv_bytes_per_s(self) -> float:
        return self.base.kv_bytes_per_s

    def collective_seconds(self, degree: int, tokens: float) -> float:
        if degree == 1:
            return 0.0
        a = self.allreduce[degree]
        return 2 * self.num_layers * (a.latency_s + tokens * self.value_bytes / a.bytes_per_s)

    def prefill_seconds(self, prompt_len: float) -> float:
        if self.prefill_measured is not None:
            return self.prefill_measured.prefill_seconds(prompt_len)
        d = self.prefill_degree
        return self.base.prefill_seconds(prompt_len) / d + self.collective_seconds(d, prompt_len)

    def prefill_capacity(self, prompt_len: float) -> float:
        if self.prefill_measured is not None:
            return self.prefill_measured.prefill_capacity(prompt_len)
        speedup = self.base.prefill_seconds(prompt_len) / self.prefill_seconds(prompt_len)
        return self.base.prefill_capacity(prompt_len) * speedup

    def decode_step_seconds(self, batch: float, context: float) -> float:
        if self.decode_measured is not None:
            return self.decode_measured.decode_step_seconds(batch, context)
        d = self.decode_degree
        return self.base.decode_step_seconds(batch, context) / d + self.collective_seconds(d, batch)

    def spec_step_seconds(self, batch: float, context: float, num_tokens: int) -> float:
        if self.decode_measured is not None:
            return self.decode_measured.spec_step_seconds(batch, context, num_tokens)
        d = self.decode_degree
        return (self.base.spec_step_seconds(batch, context, num_tokens) / d
                + self.collective_seconds(d, batch * (1 + num_tokens)))


@dataclass(slots=True)
class Parallelism:
    """One candidate of the search: degrees, counts, the req/s they carry and per device."""
    prefill_degree: int
    n_prefill: int
    decode_degree: int
    n_decode: int
    devices: int
    goodput_rps: float              # req/s the actors carry within the SLOs (the link included)
    plan: Plan

    @property
    def goodput_per_device(self) -> float:
        return self.goodput_rps / self.devices


def search_parallelism(model: PerformanceModel, workload: Workload, slo: SLO, limits: Limits, devices: int,
                       degrees: list[int], allreduce: dict[int, AllReduce],
                       network: Network | None = None,
                       decode_kv_blocks: dict[int, int] | None = None) -> list[Parallelism]:
    """Every (TP_p, n_p, TP_d, n_d) within `devices` whose prefill meets the TTFT SLO and decode the TPOT
    SLO, best first: the most req/s carried per device used, then the most req/s. For a degree pair the
    per-actor rates come from `plan` on the `DegreeModel`; the counts are every split of the devices
    (at least one actor per pool). A decode actor at degree d holds `decode_kv_blocks[d]` KV blocks where
    given (e.g. from each rank's memory left after its share of the weights), else d times
    `limits.decode_kv_blocks`. `network` is one rank's link: KV resharded by head leaves each prefill rank
    and reaches each decode rank over its own, so a handoff between degrees p and d moves over min(p, d)
    of them at once (`ranks_network`)."""
    found: list[Parallelism] = []
    for tp_p in degrees:
        for tp_d in degrees:
            blocks = (decode_kv_blocks or {}).get(tp_d, limits.decode_kv_blocks * tp_d)
            dl = Limits(blocks, limits.block_size, limits.max_batch_size)
            p = plan(DegreeModel(model, tp_p, tp_d, allreduce), workload, slo, dl,
                     network=ranks_network(network, min(tp_p, tp_d)))
            if not (p.decode["tpot_slo_met"] and p.prefill["ttft_slo_met"]):
                continue
            per_prefill = p.prefill["tokens_per_s_per_actor"] / workload.input_tokens
            per_decode = p.decode["utilization"] * p.decode["tokens_per_s_per_actor"] / workload.output_tokens
            link = p.rate_bounds.get("link", math.inf)
            for n_p in range(1, (devices - tp_d) // tp_p + 1):
                for n_d in range(1, (devices - n_p * tp_p) // tp_d + 1):
                    rate = min(n_p * per_prefill, n_d * per_decode, link)
                    found.append(Parallelism(tp_p, n_p, tp_d, n_d, n_p * tp_p + n_d * tp_d, rate, p))
    found.sort(key=lambda c: (-c.goodput_per_device, -c.goodput_rps, c.devices))
    return found
