"""Speculative decoding side by side: decode tokens/s with and without proposals, and acceptance.

On the trained `pydoc` model, one engine (what one decode actor runs), for each workload, batch
size and temperature: the same requests decoded with `speculative.method` off and with each
method asked for (`ngram`; `draft` with the trained `pydoc-draft`), in one run, printed as a
table (markdown with --markdown).

Workloads (from the model's held-out passages, never trained on):
- `heldout`: the first 128 tokens of a passage; the model continues it.
- `quote`: the passage's first 128 tokens, then its first 24 again: the model goes on quoting
  the passage back (as edits and summaries of code in the context do).

Decode tokens/s counts the tokens generated after every request of the batch has its first one,
over the time since then (prefill excluded). Each figure is the best of `--repeats` runs, the
methods interleaved run by run (on a shared machine the best run is the least disturbed one),
after `--warmup` runs of each (kernels for the shapes, and the turn-down's first measurements of
each k at this batch size: the steady state a long-running decode actor is in is what is timed);
torch runs `--threads` threads (1 by default: the tiny model's fastest, and fair to neighbours).

    pdserve bench spec [--batches 1,8,32] [--temperatures 0,0.7] [--methods ngram,draft]
                       [--draft-model pydoc-draft] [--max-tokens 64] [--num-tokens 4] [--repeats 3]
                       [--warmup 1] [--threads 1] [--json FILE] [--markdown FILE]
    pdserve bench spec --write-workload FILE [--workload quote] [--max-tokens 48]

`--write-workload` writes a workload's prompts as text, one JSON line each, for `pdserve bench serve
--workload FILE` (speculation through a cluster, colocated against disaggregated).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.serving.strict_json import write_json
from engine import Engine, EngineArgs, SamplingParams
from engine.model.presets import TRAINED
from engine.spec.config import SpecConfig

PROMPT_TOKENS = 128
QUOTE_TOKENS = 24


def heldout_passages(model: str) -> list[list[int]]:
    """The token ids of `model`'s held-out passages (a trained preset's, or a directory's)."""
    from bench.train.passages import load_passages
    return load_passages(TRAINED[model] if model in TRAINED else model)


def workloads(passages: list[list[int]]) -> dict[str, list[list[int]]]:
    return {"heldout": [p[:PROMPT_TOKENS] for p in passages],
            "quote": [p[:PROMPT_TOKENS] + p[:QUOTE_TOKENS] for p in passages]}


def decode_rate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(decode tokens/s, acceptance) of one batch run to completion."""
    spec = engine.speculator
    before = (spec.num_proposed, spec.num_accepted) if spec is not None else (0, 0)
    ids = {engine.add_request(p, params) for p in prompts}
    started: set[str] = set()
    t0, counted = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if t0 is not None:
                counted += len(out.new_token_ids)
            started.add(out.request_id)
        if t0 is None and started >= ids:
            t0 = time.perf_counter()
    seconds = time.perf_counter() - t0
    engine.block_manager.check_no_leaks()
    acceptance = float("nan")
    if spec is not None and spec.num_proposed > before[0]:
        acceptance = (spec.num_accepted - before[1]) / (spec.num_proposed - before[0])
    return counted / seconds, acceptance


def measure(batches=(1, 8, 32), temperatures=(0.0, 0.7), methods=("ngram",), max_tokens: int = 64,
            num_tokens: int = 4, model: str = "pydoc", repeats: int = 3, draft_model: str = "pydoc-draft",
            warmup: int = 1) -> list[dict]:
    passages = heldout_passages(model)
    engines = {m: Engine(EngineArgs(model, dtype="float32", num_blocks=2048, speculative=SpecConfig(
        m, num_tokens=num_tokens, draft_model=draft_model if m == "draft" else None))) for m in ("off", *methods)}
    rows = []
    for name, prompts in workloads(passages).items():
        for batch in batches:
            batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
            for temperature in temperatures:
                params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0, ignore_eos=True)
                row = {"workload": name, "batch": batch, "temperature": temperature}
                for _ in range(warmup):
                    for engine in engines.values():
                        decode_rate(engine, batch_prompts, params)      # warm: kernels, the turn-down
                for _ in range(repeats):
                    for method, engine in engines.items():
                        rate, acc = decode_rate(engine, batch_prompts, params)
                        row[method] = max(row.get(method, 0.0), rate)
                        if method != "off":
                            row[f"{method}_acceptance"] = acc
                for method in methods:
                    row[f"{method}_speedup"] = row[method] / row["off"]
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    return rows


def draft_handoff_cost(model: str = "pydoc", draft_model: str = "pydoc-draft", repeats: int = 20) -> dict:
    """What the draft's prompt KV costs a decode actor: prefilling it there (median seconds for a
    `PROMPT_TOKENS`-token prompt, beside the target's own prefill) against shipping it (bytes per token)."""
    engine = Engine(EngineArgs(model, dtype="float32", num_blocks=64,
                               speculative=SpecConfig("draft", draft_model=draft_model)))
    draft = engine.speculator.draft
    prompts = [p[:PROMPT_TOKENS] for p in heldout_passages(model)[:repeats]]
    blocks = -(-PROMPT_TOKENS // engine.block_size)
    draft_table, target_table = draft.block_manager.allocate(blocks), engine.block_manager.allocate(blocks)

    def median(fn) -> float:
        times = []
        for p in prompts:
            t0 = time.perf_counter()
            fn(p)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    return {"prompt_tokens": PROMPT_TOKENS,
            "draft_prefill_s": median(lambda p: draft._forward(p, [(0, len(p), draft_table)])),
            "target_prefill_s": median(lambda p: engine.runner.score(p, target_table)),
            "draft_kv_bytes_per_token":
                draft.kv_cache[:, 0].numel() * draft.kv_cache.element_size() // engine.block_size,
            "target_kv_bytes_per_token": engine.kv_bytes_per_block // engine.block_size}


def write_workload(path: str, name: str, max_tokens: int, model: str = "pydoc") -> int:
    """`name`'s prompts as `bench serve` JSONL rows ({"prompt": text, "output_len": max_tokens}); returns the count."""
    from engine.model.presets import resolve_model
    from engine.tokenizer import Tokenizer
    tokenizer = Tokenizer(resolve_model(model))
    prompts = workloads(heldout_passages(model))[name]
    with open(path, "w", encoding="utf-8") as f:
        for ids in prompts:
            f.write(json.dumps({"prompt": tokenizer.decode(ids), "output_len": max_tokens}) + "\n")
    return len(prompts)


def markdown(rows: list[dict], methods) -> str:
    head = "| workload | batch | temperature | off tok/s | " + " | ".join(
        f"{m} tok/s | {m} acceptance | {m} speedup" for m in methods) + " |"
    lines = [head, "|" + " --- |" * (4 + 3 * len(methods))]
    for r in rows:
        cells = [r["workload"], str(r["batch"]), f"{r['temperature']:g}", f"{r['off']:.0f}"]
        for m in methods:
            cells += [f"{r[m]:.0f}", f"{r[m + '_acceptance']:.2f}", f"{r[m + '_speedup']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench spec", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="pydoc")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--methods", default="ngram,draft")
    p.add_argument("--draft-model", default="pydoc-draft", help="the draft method's model")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-tokens", type=int, default=4, help="k: most tokens proposed per sequence and step")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (the best is kept)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per figure before the timed ones")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--write-workload", metavar="FILE", help="write --workload's prompts as JSONL for bench serve")
    p.add_argument("--workload", default="quote", choices=["heldout", "quote"])
    args = p.parse_args(argv)
    if args.write_workload:
        n = write_workload(args.write_workload, args.workload, args.max_tokens, args.model)
        print(f"wrote {n} {args.workload} requests to {args.write_workload}")
        return 0
    torch.set_num_threads(args.threads)
    methods = tuple(args.methods.split(","))
    rows = measure(tuple(int(b) for b in args.batches.split(",")),
                   tuple(float(t) for t in args.temperatures.split(",")), methods, args.max_tokens,
                   args.num_tokens, args.model, args.repeats, args.draft_model, args.warmup)
    table = markdown(rows, methods)
    if "draft" in methods:
        cost = draft_handoff_cost(args.model, args.draft_model)
        rows.append({"draft_handoff": cost})
        table += (f"\nThe draft's prompt KV on the decode actor ({cost['prompt_tokens']}-token prompt): prefilled "
                  f"there in {cost['draft_prefill_s'] * 1e3:.2f} ms (median; the target's own prefill: "
                  f"{cost['target_prefill_s'] * 1e3:.2f} ms), or shipped at {cost['draft_kv_bytes_per_token']} "
                  f"bytes per token beside the target's {cost['target_kv_bytes_per_token']}.\n")
    print(table)
    if args.json:
        write_json(args.json, rows)       # strict JSON: a figure no run gave (nan) is null
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
