"""Check the planner against the cluster: predicted vs measured per-actor throughput.

    python -m bench.serving.plan_check --config deploy/examples/rag.yaml [--profile FILE] [--json OUT]

Plans the config (cached profile, else profile first), then starts it as 1 prefill + 1 decode
actor (the pools' resources and settings; the decode actor's batch capped at the planned
batch) and saturates each stage at the workload's lengths:

  prefill  N distinct prompts of the mean input length at once — two full prefill steps' worth
           (one when that would take over a minute) — with max_tokens 2, so each KV is
           shipped: prompt tokens / (last first token − start), per prefill actor.
           Predicted: the plan's prefill capacity (tokens/s per actor at saturation).
  decode   the planned batch B of requests at once, generating K tokens each, with prompts
           sized so the mean context over the K tokens equals the workload's (prompt + out/2).
           The prompts share all but their last block, so prefill is a prefix hit and the
           decode actor holds B full-length sequences. Measured over the window where all B
           decode (last first token → first finish). Predicted: B / step(B, context).

  light    R requests one after another (nothing else running) at each of a few prompt lengths
           (the mean input length, 4× and 10× it, within the context; or --light-lengths),
           generating K tokens: the time per output token and the time to first token through the
           prefill actor and the KV handoff. Predicted: the decode step at batch 1 and that context;
           the prompt's prefill plus its KV over the profiled link.

  shared   the light phase's prompt lengths again (SHARED_REQUESTS each, max_tokens 2), one after
           another, while the decode actor decodes SHARED_BACKGROUND long requests: how much
           longer the prefill actor's stages take with the other actor busy than alone
           (`shared_prefill`), and how much longer the background's decode steps take while the
           prefill actor computes (`shared_decode`, from their time per token before and during
           the prompts and the share of that time the prefill actor was busy). Needs the light
           phase in the same run. Run --shared-rounds times over (the factors move between
           rounds); the calibration keeps each factor's median. What the simulator's
           `--shared-host` prices: on one host the actors' steps slow each other down.

Both figures are printed side by side with the error; the target is within 25%.
`--calibrate` stores predicted/measured as time factors in the profile ("calibration"), which
the planner applies from then on (serving overheads the engine-level profile cannot see:
router, token streaming, KV shipping, the other actors on the host); with the light phase it also
stores what is left at light load as fixed costs, each where the requests' timelines put it:
`step_s` added to every decode step; `send_curve`, the prefill actor's own time to send a prompt's
KV by the wire MB shipped (its stages beyond the profile's prefill, one point per length measured,
piecewise-linear between); and `handoff_s`, the rest of each handoff (the router's calls, the
transit, the adopt; `engine.performance.MeasuredPerformance`). Measure the light phase after the
factors (the default order), on a quiet host; run again to validate. With the shared phase it
also stores `shared_prefill` and `shared_decode`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable

from bench.serving.arg_types import int_list, positive_int

TAIL_TOKENS = 16
LIGHT_REQUESTS = 6
LIGHT_TOKENS = 32
SHARED_BACKGROUND = 4       # the shared phase's long requests, decoding while its prompts arrive ...
SHARED_WINDOW_S = 2.0       # ... measured alone first for this long
SHARED_REQUESTS = 12        # the shared phase's prompts of each length, one after another
SHARED_ROUNDS = 3           # the shared phase measured this many times over: the factors are the rounds' medians


async def _stream(stub, pb, rid: str, ids: list[int], max_tokens: int, sink: list, timelines: list | None = None
                  ) -> None:
    req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    async for msg in stub.Generate(req, timeout=1800):
        sink.append((time.monotonic(), len(msg.token_ids)))
        if timelines is not None and msg.HasField("timing"):
            timelines.append(msg.timing.timeline)


async def measure(cfg, plan, prefill_requests: int, decode_tokens: int, seed: int = 0,
                  phases: tuple[str, ...] = ("prefill", "decode"), light_lengths: tuple[int, ...] = (),
                  context: int = 2048, shared_rounds: int = SHARED_ROUNDS) -> dict:
    import grpc

    from deploy.launcher import load_tokenizer
    from deploy.running import start_cluster
    from proto.pdserve.v1 import generation_pb2 as pb
    from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    tokenizer, _ = load_tokenizer(cfg)
    vocab = tokenizer.vocab_size
    s_in, s_out = round(plan.workload["input_tokens"]), round(plan.workload["output_tokens"])

    def tokens(n: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(n)]

    cluster = await start_cluster(cfg, port=0)
    try:
        await cluster.server.wait_ready(120)
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            await _stream(stub, pb, "warmup", tokens(32), 2, [])
            out = {}
            if "prefill" in phases:
                out["prefill"] = await _prefill_phase(stub, pb, tokens, s_in, prefill_requests)
            if "decode" in phases:
                out["decode"] = await _decode_phase(stub, pb, tokens, plan.decode["batch"], s_in, s_out, decode_tokens)
            if "light" in phases:
                out["light"] = [await _light_phase(stub, pb, tokens, n, LIGHT_REQUESTS, LIGHT_TOKENS)
                                for n in light_lengths]
            if "shared" in phases:
                out["shared"] = shared_median([
                    await _shared_phase(stub, pb, tokens, light_lengths, SHARED_REQUESTS, out["light"], context)
                    for _ in range(shared_rounds)])
    finally:
        await cluster.stop()
    return out


async def _prefill_phase(stub, pb, tokens, s_in: int, prefill_requests: int) -> dict:
    """Distinct prompts, all at once."""
    sinks = [[] for _ in range(prefill_requests)]
    t0 = time.monotonic()
    await asyncio.gather(*(_stream(stub, pb, f"p{i}", tokens(s_in), 2, sinks[i])
                           for i in range(prefill_requests)))
    first = [s[0][0] for s in sinks]
    prefill_s = max(first) - t0
    prefill_tps = prefill_requests * s_in / prefill_s
    return {"requests": prefill_requests, "prompt_tokens": s_in, "seconds": prefill_s, "tokens_per_s": prefill_tps}


PREFILL_ACTOR_STAGES = ("prefill_compute_s", "sampling_s", "kv_encode_s", "kv_send_s")   # the sender's own time


async def _light_phase(stub, pb, tokens, s_in: int, requests: int, k: int) -> dict:
    """One request at a time: mean time to first token and per output token after it, and the mean of each
    stage of the requests' timelines (`prefill_actor_s`: the prefill actor's stages up to the send)."""
    ttft, tpot, timelines = [], [], []
    for i in range(requests):
        sink: list = []
        sent = time.monotonic()
        await _stream(stub, pb, f"l{i}", tokens(s_in), k, sink, timelines)
        ttft.append(sink[0][0] - sent)
        later = sum(n for _, n in sink[1:])
        if later:
            tpot.append((sink[-1][0] - sink[0][0]) / later)
    out = {"requests": requests, "prompt_tokens": s_in, "output_tokens": k,
           "ttft_s": sum(ttft) / len(ttft), "tpot_s": sum(tpot) / len(tpot)}
    if timelines:
        from router.timing import STAGE_NAMES
        out["stages"] = {name: sum(getattr(t, name) for t in timelines) / len(timelines) for name in STAGE_NAMES}
        out["prefill_actor_s"] = sum(out["stages"][name] for name in PREFILL_ACTOR_STAGES)
    return out


async def _shared_phase(stub, pb, tokens, lengths: tuple[int, ...], requests: int, light: list[dict],
                        context: int) -> dict:
    """The light phase's prompts again, each to its first two tokens, while SHARED_BACKGROUND requests decode:
    the prefill actor's stages (`prefill_actor_s`) with the decode actor busy, ÷ the light phase's alone, by
    length (`prefill_factors`; `shared_prefill` their mean); and the background's time per token alone
    (SHARED_WINDOW_S) and during the prompts, whose increase over the share of that time the prefill actor
    was busy is the decode step's slow-down while the other actor computes (`shared_decode`, at least 1).
    ValueError where the background finished before the prompts did (fewer or shorter --light-lengths)."""
    sinks: list[list] = [[] for _ in range(SHARED_BACKGROUND)]
    prompt = TAIL_TOKENS
    background = [asyncio.ensure_future(_stream(stub, pb, f"bg{i}", tokens(prompt), context - prompt, sinks[i]))
                  for i in range(SHARED_BACKGROUND)]
    try:
        while not all(sinks) and not any(task.done() for task in background):
            await asyncio.wait(background, timeout=0.05)            # until every one decodes
        alone_from = time.monotonic()
        await asyncio.sleep(SHARED_WINDOW_S)                         # a measuring window, not a wait for a state
        probes, timelines, alone_to = [], [], time.monotonic()
        for n in lengths:
            before = len(timelines)
            for i in range(requests):
                await _stream(stub, pb, f"s{n}-{i}", tokens(n), 2, [], timelines)
            probes.append((n, timelines[before:]))
        shared_to = time.monotonic()
        if any(task.done() for task in background):
            raise ValueError(f"the shared phase's {SHARED_BACKGROUND} background requests finished before its "
                             f"prompts did (a context of {context}): measure fewer or shorter --light-lengths")
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)

    def per_token(start: float, end: float) -> float:
        counted = sum(n for sink in sinks for t, n in sink if start < t <= end)
        if not counted:
            raise ValueError(f"the shared phase's background requests made no token in {end - start:.1f} s")
        return SHARED_BACKGROUND * (end - start) / counted

    loaded = {n: [sum(getattr(t, s) for s in PREFILL_ACTOR_STAGES) for t in ts] for n, ts in probes}
    return {"background": SHARED_BACKGROUND,
            **shared_factors(light, loaded, per_token(alone_from, alone_to), per_token(alone_to, shared_to),
                             shared_to - alone_to)}


def shared_median(rounds: list[dict]) -> dict:
    """Several rounds of the shared phase: each round as measured, and each factor's median over them."""
    return {"rounds": rounds, "shared_prefill": statistics.median(r["shared_prefill"] for r in rounds),
            "shared_decode": statistics.median(r["shared_decode"] for r in rounds)}


def shared_factors(light: list[dict], loaded: dict[int, list[float]], tpot_alone: float, tpot_shared: float,
                   window_s: float) -> dict:
    """The shared phase's factors from what it measured: `loaded`, each length's prefill-actor times with the
    decode actor busy (the light phase's `prefill_actor_s` is the same alone); the background's time per
    token before (`tpot_alone`) and during the `window_s` the prompts took (`tpot_shared`). `shared_prefill`:
    the mean over lengths of loaded ÷ alone; `shared_decode`: 1 + the relative rise in time per token over
    the share of the window the prefill actor was busy (a step slows only while the other computes). Neither
    below 1: on a shared host noise only adds time."""
    alone = {m["prompt_tokens"]: m["prefill_actor_s"] for m in light}
    means = {n: sum(times) / len(times) for n, times in loaded.items()}
    factors = {n: means[n] / alone[n] for n in means}
    busy = min(sum(sum(times) for times in loaded.values()) / window_s, 1.0)
    return {"tpot_alone_s": tpot_alone, "tpot_shared_s": tpot_shared, "prefill_busy_share": busy,
            "prefill_actor_s": means, "prefill_factors": factors,
            "shared_prefill": max(sum(factors.values()) / len(factors), 1.0),
            "shared_decode": max(1.0 + (tpot_shared / tpot_alone - 1.0) / busy, 1.0) if busy > 0 else 1.0}


def light_predictions(model, s_in: int, k: int, wire_ratio: float) -> dict:
    """What the profile says one lone request takes: TPOT = the time per output token at batch 1 and the mean
    context (the decode step, or with speculative decoding the step over the tokens it yields), TTFT = its
    prefill + its KV over the link (both with the profile's fixed costs, if it has any)."""
    from bench.simulate.measured import MeasuredModel
    link = MeasuredModel(model)
    wire = s_in * model.costs.kv_bytes_per_token * wire_ratio
    step = model.decode_step(1, s_in + k / 2)
    send = link.send_busy_s(wire)
    prefill_actor = model.prefill_seconds(s_in) + send
    return {"tpot_s": step.token_s, "tokens_per_step": step.tokens_per_step, "wire_bytes": wire, "send_s": send,
            "prefill_actor_s": prefill_actor, "ttft_s": prefill_actor + link.link_s(wire)}


def light_lengths(s_in: int, longest: int) -> tuple[int, ...]:
    """The light phase's prompt lengths: the mean input, 4× and 10× it, none past `longest`."""
    return tuple(sorted({max(min(n, longest), 1) for n in (s_in, 4 * s_in, 10 * s_in)}))


def fixed_costs(calibration: dict, light: list[tuple[dict, dict]]) -> dict:
    """The calibration with its fixed costs moved by what the light phase measured beyond the prediction,
    `light` holding (predicted, measured) at each prompt length:

    - `step_s` by the mean TPOT gap (per step: times the tokens a step yields, with speculative decoding
      more than one);
    - `send_curve`, the prefill actor's time to send a prompt's KV by the wire MB it ships (the simulator
      lengthens the sending step by it): at each length the send time predicted so far plus the prefill
      actor's own gap (its timeline stages up to the send, `prefill_actor_s`, beyond the prediction),
      one point a length; the older `send_s` and `send_s_per_mb` are folded into it;
    - `handoff_s` by the mean of the rest of the TTFT gap (the router's calls, the transit, the adopt).

    A measurement without stages puts the whole TTFT gap on the prefill actor. No cost goes below zero."""
    out = {k: v for k, v in calibration.items() if k not in ("send_s", "send_s_per_mb")}
    step_gaps = [(m["tpot_s"] - p["tpot_s"]) * p.get("tokens_per_step", 1.0) for p, m in light]
    out["step_s"] = max(out.get("step_s", 0.0) + sum(step_gaps) / len(step_gaps), 0.0)
    ttft_gaps = [m["ttft_s"] - p["ttft_s"] for p, m in light]
    actor_gaps = [m["prefill_actor_s"] - p["prefill_actor_s"] if "prefill_actor_s" in m else g
                  for (p, m), g in zip(light, ttft_gaps)]
    by_mb: dict[float, list[float]] = {}
    for (p, _), gap in zip(light, actor_gaps):
        by_mb.setdefault(round(p["wire_bytes"] / 1e6, 6), []).append(max(p["send_s"] + gap, 0.0))
    out["send_curve"] = [[mb, sum(ys) / len(ys)] for mb, ys in sorted(by_mb.items())]
    rest = [t - a for t, a in zip(ttft_gaps, actor_gaps)]
    out["handoff_s"] = max(out.get("handoff_s", 0.0) + sum(rest) / len(rest), 0.0)
    return out


def calibrate(profile: dict, factors: dict[str, float], light: list[dict],
              predict: Callable[[dict, int], dict] | None) -> dict:
    """The profile's calibration after a run: each time factor multiplied by `factors` (predicted ÷ measured
    at saturation), then the light phase's fixed costs (`fixed_costs`) against what the profile predicts
    with those factors (`predict(profile data, prompt tokens)`, `light_predictions`), so that time the new
    factors already account for is not added again as a fixed cost."""
    cal = dict(profile.get("calibration", {}))
    for key, factor in factors.items():
        cal[key] = cal.get(key, 1.0) * factor
    if light:
        data = {**profile, "calibration": cal}
        cal = fixed_costs(cal, [(predict(data, m["prompt_tokens"]), m) for m in light])
    return cal


async def _decode_phase(stub, pb, tokens, batch: int, s_in: int, s_out: int, decode_tokens: int) -> dict:
    """B sequences at the mean context; prompts share all but their last block."""
    k = min(decode_tokens, s_out)
    prompt_len = max(s_in + (s_out - k) // 2, TAIL_TOKENS + 1)
    prefix = tokens(prompt_len - TAIL_TOKENS)
    await _stream(stub, pb, "prefix", prefix + tokens(TAIL_TOKENS), 1, [])
    sinks = [[] for _ in range(batch)]
    await asyncio.gather(*(_stream(stub, pb, f"d{i}", prefix + tokens(TAIL_TOKENS), k, sinks[i])
                           for i in range(batch)))
    start = max(s[0][0] for s in sinks)          # every sequence is decoding from here
    end = min(s[-1][0] for s in sinks)            # until the first one finishes
    counted = sum(n for s in sinks for t, n in s[1:] if start < t <= end)
    window = end - start
    if window <= 0 or counted == 0:               # the batch never ran whole: whole-phase rate
        start, end = min(s[0][0] for s in sinks), max(s[-1][0] for s in sinks)
        counted, window = sum(n for s in sinks for _, n in s[1:]), end - start
    decode_tps = counted / window
    return {"batch": batch, "prompt_tokens": prompt_len, "generated_per_request": k, "window_s": window,
    "tokens_counted": counted, "tokens_per_s": decode_tps}


def main(argv: list[str] | None = None) -> int:
    from deploy.config import load_config
    from deploy.plan_cli import format_plan, obtain_profile, plan_for
    p = argparse.ArgumentParser(prog="python -m bench.serving.plan_check", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--profile", help="profile file (default: the config's cached profile, else profile first)")
    p.add_argument("--local", action="store_true", help="profile in-process engines when there is no profile")
    p.add_argument("--prefill-requests", type=int, help="default: two saturated prefill steps' worth")
    p.add_argument("--decode-tokens", type=int, default=100, help="tokens each decode-phase request generates")
    p.add_argument("--phases", default="prefill,decode,light", help="which stages to measure: prefill, decode, "
                   "light, shared (with light)")
    p.add_argument("--light-lengths", type=int_list, metavar="N,N,…", help="the light phase's prompt lengths "
                   "(default: the workload's mean input length, 4× and 10× it, within the context)")
    p.add_argument("--shared-rounds", type=positive_int, default=SHARED_ROUNDS, metavar="N",
                   help="how many times the shared phase measures (the calibration keeps the medians)")
    p.add_argument("--calibrate", action="store_true",
                   help="store measured/predicted time factors in the profile (the planner then applies them)")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    profile, source = obtain_profile(cfg, args.profile, args.local)
    plan = plan_for(cfg, profile)
    print(format_plan(plan, cfg.model.name, source), flush=True)
    from deploy.launcher import engine_args
    from engine.model.config import ModelConfig
    from engine.model.presets import resolve_model
    pargs = engine_args(cfg, "prefill", resolve_model(cfg.model.name))
    s_in = round(plan.workload["input_tokens"])
    per_step = max(1, min(pargs.max_num_batched_tokens // s_in, pargs.max_num_seqs))   # prompts a full step takes
    one_step_s = per_step * s_in / plan.prefill["capacity_tokens_per_s"]
    n = args.prefill_requests or (2 * per_step if 2 * one_step_s <= 60 else per_step)
    bench_cfg = load_config(args.config, {"pools.prefill.count": 1, "pools.decode.count": 1,
                                          "pools.decode.max_batch_size": plan.decode["batch"]})
    phases = tuple(args.phases.split(","))
    unknown = [ph for ph in phases if ph not in ("prefill", "decode", "light", "shared")]
    if unknown:
        p.error(f"--phases: unknown phase {unknown[0]!r} (prefill, decode, light, shared)")
    if "shared" in phases and "light" not in phases:
        p.error("--phases: shared compares with the light phase of the same run: add light")
    shape = ModelConfig.from_dir(resolve_model(cfg.model.name))
    longest = min(cfg.model.max_model_len or shape.context_limit, shape.context_limit)
    lengths = args.light_lengths or light_lengths(s_in, longest - LIGHT_TOKENS)
    if max(lengths) + LIGHT_TOKENS > longest:
        p.error(f"--light-lengths: {max(lengths)} + {LIGHT_TOKENS} generated tokens exceed the context ({longest})")
    try:
        measured = asyncio.run(measure(bench_cfg, plan, n, args.decode_tokens, phases=phases, light_lengths=lengths,
                                       context=longest, shared_rounds=args.shared_rounds))
    except ValueError as e:
        print(f"plan_check: {e}", file=sys.stderr)
        return 1
    rows = []
    if "prefill" in measured:
        rows.append(("prefill tokens/s per actor (saturated)", plan.prefill["capacity_tokens_per_s"],
                     measured["prefill"]["tokens_per_s"]))
    if "decode" in measured:
        rows.append((f"decode tokens/s per actor (batch {plan.decode['batch']})",
                     plan.decode["tokens_per_s_per_actor"], measured["decode"]["tokens_per_s"]))
    if "light" in measured:
        from engine.performance import MeasuredPerformance
        from kv_transfer import wire_bytes_per_kv_byte
        from deploy.performance import speculation_of
        model = MeasuredPerformance(profile, speculation_of(cfg, resolve_model(cfg.model.name), profile))
        ratio = wire_bytes_per_kv_byte(cfg.transfer_codec(), model.costs.dtype_bytes, cfg.kv_cache.block_size,
                                       shape.head_dim)

        def predict(data: dict, prompt_tokens: int) -> dict:
            spec = speculation_of(cfg, resolve_model(cfg.model.name), data)
            return light_predictions(MeasuredPerformance(data, spec), prompt_tokens, LIGHT_TOKENS, ratio)
        for light in measured["light"]:
            light["predicted"] = predicted = predict(profile, light["prompt_tokens"])
            rows.append((f"one {light['prompt_tokens']}-token request: TPOT (ms)", 1e3 * predicted["tpot_s"],
                         1e3 * light["tpot_s"]))
            rows.append((f"one {light['prompt_tokens']}-token request: TTFT (ms)", 1e3 * predicted["ttft_s"],
                         1e3 * light["ttft_s"]))
    print(f"\nplan check — {args.config}, 1 prefill + 1 decode actor")
    print(f"{'':<42} {'predicted':>10} {'measured':>10} {'error':>8}")
    for name, pred, meas in rows:
        print(f"{name:<42} {pred:>10.1f} {meas:>10.1f} {(meas - pred) / pred:>+8.0%}")
    ok = all(abs(meas - pred) / pred <= 0.25 for _, pred, meas in rows)
    print(f"within 25%: {'yes' if ok else 'no'}")
    if "shared" in measured:
        for i, sh in enumerate(measured["shared"]["rounds"], 1):
            by_length = ", ".join(f"{n} tokens {f:.2f}×" for n, f in sh["prefill_factors"].items())
            print(f"shared host, round {i}: the prefill actor's stages with {sh['background']} requests decoding "
                  f"beside it take {sh['shared_prefill']:.2f}× their time alone ({by_length}); the decode step while "
                  f"the prefill actor computes {sh['shared_decode']:.2f}× (time per token "
                  f"{1e3 * sh['tpot_alone_s']:.1f} ms → {1e3 * sh['tpot_shared_s']:.1f} ms, the prefill actor busy "
                  f"{sh['prefill_busy_share']:.0%} of it)")
        print(f"shared host, the rounds' medians: prefill ×{measured['shared']['shared_prefill']:.2f}, "
              f"decode ×{measured['shared']['shared_decode']:.2f}")
    if args.calibrate:
        from deploy.profiler import save_profile
        factors = {key: pred / meas for key, (_, pred, meas) in zip([k for k in ("prefill", "decode") if k in measured],
                                                                     rows)}
        cal = calibrate(profile, factors, measured.get("light", []), predict if "light" in measured else None)
        if "shared" in measured:
            cal["shared_prefill"] = measured["shared"]["shared_prefill"]
            cal["shared_decode"] = measured["shared"]["shared_decode"]
        profile["calibration"] = cal
        save_profile(profile, source)
        print(f"calibration saved to {source}: " + ", ".join(
            f"{k} {1e3 * v:.2f} ms" if k.endswith("_s") else f"{k} {1e3 * v:.2f} ms/MB" if k.endswith("_per_mb")
            else f"{k} [" + "; ".join(f"{mb:.2f} MB {1e3 * y:.1f} ms" for mb, y in v) + "]" if k == "send_curve"
            else f"{k} ×{v:.2f}" for k, v in cal.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": args.config, "profile": source, "plan": plan.to_dict(), "measured": measured,
                       "within_25pct": ok}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
