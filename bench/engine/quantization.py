"""Fewer bytes per decode step side by side: one engine per weight quantization and KV cache dtype.

    python -m bench.engine --quantization none,int8,int4,int8+head,int4+head [--model small] [--quick]
    python -m bench.engine --quantization none --kv-cache-dtype auto,fp8,int8 --decode-context 1024

(`+head`: the LM head quantized too; `+kv-fp8`: an engine with `kv_cache_dtype` fp8, of every
`--quantization` value but none with kv-auto, which is `none` itself.)

Every engine is built first; then each figure is taken from all of them in turn, repetition by
repetition in alternating order (A/B/C, C/B/A, ...), and is the median, so machine noise hits them
alike. Beside them the machine's memcpy, measured in the same run:

1. prefill: one prompt of 512 and of 2048 tokens through `Engine.generate` (max_tokens=1);
2. decode: B sequences of a 256-token context, mean `Engine.step()` time at B = 1, 8, 32, and the
   bytes it reads (engine/cost_model.py: the weights as stored, int8 / int4 codes and their scales
   included, and the KV) per second, over memcpy's bytes copied per second.

Targets: at batch 1 an int8 step <= 0.6x and an int4 step <= 0.4x the unquantized one; prefill no
slower than 1.1x unquantized; at batch 32 (run with `--decode-context 1024`) an fp8 cache's step <= 0.8x
the model-dtype cache's. The unquantized engine must be in the list (`none`).
"""
from __future__ import annotations

import random
import statistics

import torch

from bench.engine import peers
from bench.engine.ours import OursDecoder, load_average, ours_prefill, random_prompt
from bench.engine.report import markdown_table, table, target_rows
from engine import Engine, EngineArgs
from engine.profile import engine_costs

STEP_TARGETS = {"int8": 0.6, "int4": 0.4}      # batch-1 decode step vs unquantized
KV_TARGETS = {"fp8": ("32", 0.8)}                # (batch, step vs the model-dtype cache)
PREFILL_TARGET = 1.1
HEAD = "+head"          # `int8+head`: the LM head quantized too (EngineArgs.quantize_lm_head)
KV = "+kv-"             # `none+kv-fp8`: the KV cache stored fp8 (EngineArgs.kv_cache_dtype)


def kv_of(name: str) -> str:
    """The KV cache dtype of an engine's name (`int8+kv-fp8` -> `fp8`; default auto)."""
    return name.split(KV, 1)[1] if KV in name else "auto"


def scheme_of(name: str) -> str:
    """The quantization scheme of an engine's name (`int4+head+kv-fp8` -> `int4`)."""
    return name.split(KV, 1)[0].removesuffix(HEAD)


def engine_names(quantizations: list[str], kv_dtypes: list[str]) -> list[str]:
    """Every (weights, KV cache) pair, `none` first."""
    names = [q if kv == "auto" else f"{q}{KV}{kv}" for q in quantizations for kv in kv_dtypes or ["auto"]]
    return ["none"] + [n for n in names if n != "none"]


def _alternating(names: list[str], rep: int) -> list[str]:
    return names if rep % 2 == 0 else names[::-1]


def build_engines(plan, model: str, dtype: str, quantizations: list[str], attention: str, weight_layout: str,
                  group_size: int) -> dict[str, Engine]:
    blocks_per_seq = -(-(plan.decode_context + (plan.decode_repeats + 1) * plan.decode_steps + 24) // 16)
    num_blocks = max(plan.decode_batches) * blocks_per_seq + max(plan.prefill_lens) // 16 + 8
    return {q: Engine(EngineArgs(model, dtype=dtype, num_blocks=num_blocks,
                                 max_num_batched_tokens=max(4096, *plan.prefill_lens), chunk_size=None,
                                 max_num_seqs=max(64, *plan.decode_batches), attention=attention,
                                 weight_layout=weight_layout, quantization=scheme_of(q),
                                 quantization_group_size=group_size, quantize_lm_head=HEAD in q,
                                 kv_cache_dtype=kv_of(q)))
            for q in quantizations}


def bench_prefill(plan, engines: dict[str, Engine], vocab: int, rng, log) -> dict:
    names = list(engines)
    results: dict[str, dict] = {q: {} for q in names}
    for nominal in plan.prefill_lens:
        seq_len = min(nominal, min(e.max_model_len for e in engines.values()) - 1)
        for q in names:                                                      # warm-up
            ours_prefill(engines[q], random_prompt(rng, seq_len, vocab))
        times: dict[str, list[float]] = {q: [] for q in names}
        for rep in range(plan.prefill_repeats):
            prompt = random_prompt(rng, seq_len, vocab)
            for q in _alternating(names, rep):
                times[q].append(ours_prefill(engines[q], prompt))
            log(f"prefill {seq_len}: rep {rep + 1}/{plan.prefill_repeats} "
                + ", ".join(f"{q} {times[q][-1]:.3f}s" for q in names))
        for q in names:
            results[q][str(nominal)] = {"tokens": seq_len, "s": statistics.median(times[q]), "s_all": times[q]}
    return results


def bench_decode(plan, engines: dict[str, Engine], vocab: int, rng, log) -> dict:
    names = list(engines)
    results: dict[str, dict] = {q: {} for q in names}
    for batch in plan.decode_batches:
        prompts = [random_prompt(rng, plan.decode_context, vocab) for _ in range(batch)]
        total_steps = (plan.decode_repeats + 1) * plan.decode_steps
        # (+ batch: the first prompts decode while later ones prefill, a step per token-budget's worth)
        sides = {q: OursDecoder(engines[q], prompts, total_steps + 4 + batch) for q in names}
        for side in sides.values():
            side.steps(2)                                                    # warm-up
        times: dict[str, list[float]] = {q: [] for q in names}
        for rep in range(plan.decode_repeats):
            for q in _alternating(names, rep):
                times[q].append(sides[q].steps(plan.decode_steps))
            log(f"decode batch {batch}: rep {rep + 1}/{plan.decode_repeats} "
                + ", ".join(f"{q} {times[q][-1] * 1e3:.1f}ms" for q in names))
        context = plan.decode_context + 3 + plan.decode_steps * plan.decode_repeats / 2
        for q in names:
            sides[q].close()
            step = statistics.median(times[q])
            step_bytes = engine_costs(engines[q]).decode_bytes(batch, context)
            results[q][str(batch)] = {"s": step, "s_all": times[q], "context": context, "step_bytes": step_bytes,
                                      "bytes_per_s": step_bytes / step, "tokens_per_s": batch / step}
    return results


def check_targets(result: dict) -> list[dict]:
    out = []
    base = result["runs"]["none"]
    for q, run in result["runs"].items():
        if q == "none":
            continue
        kv = KV_TARGETS.get(kv_of(q))
        if kv is not None and scheme_of(q) == "none" and kv[0] in run["decode"]:
            batch, limit = kv
            ratio = run["decode"][batch]["s"] / base["decode"][batch]["s"]
            context = base["decode"][batch]["context"]
            out.append({"target": f"{q} decode batch {batch}, context {context:.0f}: step vs none", "value": ratio,
                        "goal": f"<= {limit:.2f}x", "pass": ratio <= limit})
        goal = STEP_TARGETS.get(scheme_of(q)) if kv_of(q) == "auto" else None
        if goal is not None and "1" in run["decode"]:
            ratio = run["decode"]["1"]["s"] / base["decode"]["1"]["s"]
            out.append({"target": f"{q} decode batch 1: step vs none", "value": ratio,
                        "goal": f"<= {goal:.2f}x", "pass": ratio <= goal})
        for length, p in run["prefill"].items():
            ratio = p["s"] / base["prefill"][length]["s"]
            out.append({"target": f"{q} prefill {length}: time vs none", "value": ratio,
                        "goal": f"<= {PREFILL_TARGET:.2f}x", "pass": ratio <= PREFILL_TARGET})
    return out


def rows(result: dict) -> tuple[list[str], list[list[str]]]:
    bw = result["machine"]["memcpy"]["bytes_per_s"]
    runs = result["runs"]
    base = runs["none"]
    head = ["figure"] + list(runs)
    body = [["weights read per decode step (MB)"] + [f"{r['weight_bytes'] / 1e6:.1f}" for r in runs.values()],
            ["KV bytes per token (cache as stored)"] + [f"{r['kv_bytes_per_token']:.0f}" for r in runs.values()],
            ["quantized projections (plan)"] + [r["plan"] or "-" for r in runs.values()]]
    for length, p in base["prefill"].items():
        body.append([f"prefill {p['tokens']} tok: ms (vs none)"]
                    + [f"{r['prefill'][length]['s'] * 1e3:.0f} ({r['prefill'][length]['s'] / p['s']:.2f}x)"
                       for r in runs.values()])
    for batch, d in base["decode"].items():
        body.append([f"decode batch {batch}, ctx {d['context']:.0f}: ms/step (vs none)"]
                    + [f"{r['decode'][batch]['s'] * 1e3:.1f} ({r['decode'][batch]['s'] / d['s']:.2f}x)"
                       for r in runs.values()])
        body.append([f"decode batch {batch}: GB/s read, of memcpy {bw / 1e9:.1f} GB/s"]
                    + [f"{r['decode'][batch]['bytes_per_s'] / 1e9:.1f} = {r['decode'][batch]['bytes_per_s'] / bw:.0%}"
                       for r in runs.values()])
    return head, body


def title(result: dict) -> str:
    return (f"pdserve engine, quantized weights and KV cache: model {result['model']}, decode context "
            f"{result.get('decode_context', 256)}, {result['dtype']}, int4 group "
            f"{result['group_size']}, {result['torch_threads']} torch threads, {result['attention']} decode attention, "
            f"{result['weight_layout']} dense weights, torch {result['torch_version']}, load average "
            f"{result['load_average_start']:.1f} -> {result['load_average_end']:.1f}" + (" (quick)" if result["quick"]
                                                                                        else ""))


def render_text(result: dict) -> str:
    return "\n\n".join([title(result), table(*rows(result)), table(*target_rows(result))])


def render_markdown(result: dict) -> str:
    return "\n\n".join([title(result), markdown_table(*rows(result)), markdown_table(*target_rows(result))]) + "\n"


def run(args, plan, log) -> dict:
    """The comparison (module docstring) for the suite's parsed `args` and `plan`."""
    quantizations = engine_names([q for q in args.quantization.split(",") if q] or ["none"],
                                 [k for k in args.kv_cache_dtype.split(",") if k])
    load_start = load_average()
    machine = {"memcpy": peers.memcpy_bandwidth(plan.memcpy_bytes, 5)}
    log(f"memcpy {machine['memcpy']['bytes_per_s'] / 1e9:.1f} GB/s; building engines: {', '.join(quantizations)}")
    engines = build_engines(plan, args.model, args.dtype, quantizations, args.attention, args.weight_layout,
                            args.group_size)
    first = next(iter(engines.values()))
    for q, e in engines.items():
        log(f"{q}: attention {e.attention}, dense weights {e.model.weight_layout}, projections "
            f"{e.model.quant or 'dense'}")
    rng = random.Random(plan.seed)
    prefill = bench_prefill(plan, engines, first.vocab_size, rng, log)
    decode = bench_decode(plan, engines, first.vocab_size, rng, log)
    result = {"model": args.model, "dtype": args.dtype, "quick": args.quick, "group_size": args.group_size,
              "decode_context": plan.decode_context,
              "torch_threads": torch.get_num_threads(), "attention": first.attention,
              "weight_layout": first.model.weight_layout, "torch_version": torch.__version__,
              "load_average_start": load_start, "load_average_end": load_average(), "machine": machine,
              "runs": {q: {"plan": str(e.model.quant) if e.model.quant else None,
                           "weight_bytes": engine_costs(e).weight_bytes,
                           "kv_bytes_per_token": engine_costs(e).kv_bytes_per_token,
                           "prefill": prefill[q], "decode": decode[q]}
                       for q, e in engines.items()}}
    result["targets"] = check_targets(result)
    return result
