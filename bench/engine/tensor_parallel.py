"""`python -m bench.engine --tp 1,2`: the engine at each tensor-parallel degree on this machine's CPUs.

Degree d runs d gloo ranks (rank 0 here, the others in spawned processes) of `threads / d` torch threads
each, against degree 1 with all `threads` threads (default threads: the largest degree): the same cores,
split by rank instead of by thread. For each degree: prefill time of one prompt per length, decode step
time per batch size (a pure decode batch of a fixed context), and the time rank 0 spends in all-reduces
per prefill / step (its wait for the slowest rank included), and the speed-up over degree 1, side by side.

The planner's model (`deploy.planner.tp_speedup`) assumes each rank brings a device of its own: degree N
runs degree 1's time on one device split evenly over N devices, plus the all-reduce time measured at that
degree. On CPU "a device" is the threads one rank runs, so degree 1 is also measured on one rank's threads
(the one-device baseline, when that differs from all the threads): the table prints the speed-up over
degree 1 on all the cores (what splitting these cores by rank buys: CPU tensor parallelism is not fast)
and the speed-up over one device beside the planner's prediction of it (what the model is judged on).
"""
from __future__ import annotations

import random
import statistics

import torch

from bench.engine.ours import OursDecoder, load_average, ours_prefill, random_prompt
from bench.engine.report import table
from engine import Engine, EngineArgs
from engine.local_ranks import start_local_group
from engine.parallel.group import free_port


def build(plan, args, degree: int, threads: int) -> tuple[Engine, list]:
    """Rank 0 of `degree` here (its peers spawned), each rank on `threads` torch threads."""
    blocks_per_seq = -(-(plan.decode_context + (plan.decode_repeats + 1) * plan.decode_steps + 24) // 16)
    engine_args = EngineArgs(args.model, dtype=args.dtype, num_blocks=max(plan.decode_batches) * blocks_per_seq
                             + max(plan.prefill_lens) // 16 + 8, max_num_batched_tokens=max(4096, *plan.prefill_lens),
                             chunk_size=None, max_num_seqs=max(64, *plan.decode_batches), attention=args.attention,
                             weight_layout=args.weight_layout, torch_threads=threads, tensor_parallel=degree,
                             tensor_parallel_address=f"127.0.0.1:{free_port()}", tensor_parallel_timeout_s=600)
    return start_local_group(engine_args)


def measure(plan, engine: Engine, rng: random.Random, log, name: str) -> dict:
    group, vocab = engine.tp.group, engine.vocab_size
    out: dict = {"prefill": {}, "decode": {}}
    for nominal in plan.prefill_lens:
        length = min(nominal, engine.max_model_len - 1)
        ours_prefill(engine, random_prompt(rng, length, vocab))                    # warm-up
        times, reduces = [], []
        for _ in range(plan.prefill_repeats):
            before = group.reduce_s
            times.append(ours_prefill(engine, random_prompt(rng, length, vocab)))
            reduces.append(group.reduce_s - before)
        out["prefill"][str(nominal)] = {"tokens": length, "s": statistics.median(times),
                                        "allreduce_s": statistics.median(reduces), "s_all": times}
        log(f"{name}: prefill {length} tokens {out['prefill'][str(nominal)]['s']:.3f}s")
    for batch in plan.decode_batches:
        prompts = [random_prompt(rng, plan.decode_context, vocab) for _ in range(batch)]
        decoder = OursDecoder(engine, prompts, (plan.decode_repeats + 1) * plan.decode_steps + 4 + batch)
        decoder.steps(2)                                                            # warm-up
        times, reduces = [], []
        for _ in range(plan.decode_repeats):
            before = group.reduce_s
            times.append(decoder.steps(plan.decode_steps))
            reduces.append((group.reduce_s - before) / plan.decode_steps)
        decoder.close()
        out["decode"][str(batch)] = {"s": statistics.median(times), "allreduce_s": statistics.median(reduces),
                                     "s_all": times}
        log(f"{name}: decode batch {batch} step {out['decode'][str(batch)]['s'] * 1e3:.1f}ms")
    return out


def run(args, plan, log) -> dict:
    from deploy.planner import tp_speedup
    degrees = sorted({int(d) for d in args.tp.split(",") if d})
    threads = args.threads or max(degrees)
    load_start = load_average()
    shapes = [(degree, max(threads // degree, 1)) for degree in degrees]
    # one-device baselines: degree 1 on each rank's thread count that differs from degree 1's own
    baselines = sorted({(1, per_rank) for degree, per_rank in shapes if degree > 1} - set(shapes))
    runs, devices = {}, {}
    for (degree, per_rank), baseline in [*((s, False) for s in shapes), *((s, True) for s in baselines)]:
        name = f"tp 1 on {per_rank} thread(s)" if baseline else f"tp {degree}"
        engine, peers = build(plan, args, degree, per_rank)
        torch.set_num_threads(per_rank)
        log(f"{name}: {degree} rank(s) x {per_rank} thread(s), attention {engine.attention}, "
            f"weights {engine.model.weight_layout}")
        try:
            run = {"ranks": degree, "threads_per_rank": per_rank,
                   **measure(plan, engine, random.Random(plan.seed), log, name)}
        finally:
            engine.close()
            for p in peers:
                p.join(60)
        if not baseline:
            runs[str(degree)] = run
        if degree == 1:
            devices[per_rank] = run
    base = runs[str(degrees[0])]
    for r in runs.values():
        device = devices[r["threads_per_rank"]]
        for phase in ("prefill", "decode"):
            for key, point in r[phase].items():
                point["speedup"] = base[phase][key]["s"] / point["s"]
                point["device_s"] = device_s = device[phase][key]["s"]
                point["device_speedup"] = device_s / point["s"]
                point["predicted_speedup"] = tp_speedup(device_s, r["ranks"] / base["ranks"], point["allreduce_s"])
    return {"model": args.model, "dtype": args.dtype, "quick": args.quick, "threads": threads,
            "decode_context": plan.decode_context, "torch_version": torch.__version__,
            "load_average_start": load_start, "load_average_end": load_average(), "tp": runs}


def rows(result: dict) -> tuple[list[str], list[list[str]]]:
    head = ["tp", "ranks x threads", "phase", "size", "time", "speed-up (same cores)", "one device",
            "speed-up over one device", "planner's speed-up", "all-reduce / step"]
    body = []

    def seconds(phase: str, s: float) -> str:
        return f"{s:.3f} s" if phase == "prefill" else f"{s * 1e3:.1f} ms"

    for degree, r in result["tp"].items():
        for phase, unit in (("prefill", "tokens"), ("decode", "batch")):
            for key, p in r[phase].items():
                body.append([degree, f"{r['ranks']} x {r['threads_per_rank']}", phase, f"{key} {unit}",
                             seconds(phase, p["s"]), f"{p['speedup']:.2f}x",
                             f"{seconds(phase, p['device_s'])} (1 x {r['threads_per_rank']})",
                             f"{p['device_speedup']:.2f}x", f"{p['predicted_speedup']:.2f}x",
                             f"{p['allreduce_s'] * 1e3:.2f} ms"])
    return head, body


def title(result: dict) -> str:
    return (f"tensor parallelism, model {result['model']} {result['dtype']}, {result['threads']} threads in all, "
            f"decode context {result['decode_context']}, load average {result['load_average_start']:.1f} → "
            f"{result['load_average_end']:.1f}")


def render_text(result: dict) -> str:
    return f"{title(result)}\n{table(*rows(result))}"


def render_markdown(result: dict) -> str:
    from bench.engine.report import markdown_table
    return f"**{title(result)}**\n\n{markdown_table(*rows(result))}\n"
