"""Token-mask cost of the grammar libraries: `python -m bench.structured.mask_bench [--json FILE]`.

Per library x vocabulary: the tokenizer set-up (once per tokenizer), the compile time of a nested
JSON schema (best of a few fresh compiles, no cache), and the per-step cost at batch 1 and 32 of
what the sampler does for a constrained sequence: fill the allowed-token bitmask of every row, apply
it to a float32 logits batch (the engine's `apply_token_bitmask`, the same for every library) and
advance every matcher by one accepted token. The matchers walk the tokens of a valid document (its
tokenization by the vocabulary's own tokenizer); each repeat starts fresh matchers from the compiled
grammar, and the figure is the median over repeats of the mean step. Beside it, in the same run: the
machine's matmul / memcpy limits (bench.engine.peers) and a batch-32 decode step of the `small` preset,
the yardstick of the goal (mask ≤ 10% of that step). A feature table says what each library can express.

Only llguidance is a dependency; to compare, `pip install "xgrammar<0.3" "outlines-core<0.3"` (xgrammar
pulls in triton and apache-tvm-ffi). A library that is not installed is skipped.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.engine import peers
from bench.engine.report import markdown_table, table
from bench.structured import vocab as vocabs
from bench.structured.libraries import LIBRARIES, PROBES, Library, probe
from engine.sampling.grammar import apply_token_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 40},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 60}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
        "orders": {
            "type": "array", "maxItems": 4,
            "items": {"type": "object",
                      "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                                     "price": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
                      "required": ["sku", "qty"], "additionalProperties": False}},
    },
    "required": ["id", "name", "role", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "id": 4211, "name": "Ada Lovelace", "active": True, "score": 0.875, "role": "editor",
    "address": {"street": "12 Marylebone Road", "city": "London", "zip": "10115"},
    "tags": ["analyst", "engine", "notes"],
    "orders": [{"sku": "BAB-0001", "qty": 2, "price": 19.5}, {"sku": "DIF-2", "qty": 1, "price": None}],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.structured.mask_bench", description=__doc__.split("\n")[0])
    p.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated (default: all three)")
    p.add_argument("--vocabs", default="pydoc,small,synthetic-150k", help="comma-separated (default: %(default)s)")
    p.add_argument("--batches", default="1,32", help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="walks of the document per batch size (default: 5)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for torch and for the libraries' batch APIs (default: torch's own choice)")
    p.add_argument("--no-decode-step", action="store_true", help="skip the `small` decode-step yardstick")
    p.add_argument("--json", help="write every figure to this JSON file")
    p.add_argument("--markdown", help="write the tables as Markdown to this file")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[mask_bench] {msg}", file=sys.stderr, flush=True)


def best_time(fn, repeats: int) -> float:
    return min(peers.timed(fn) for _ in range(repeats))


def walk(lib: Library, compiled, tokens: list[int], batch: int, vocab_size: int) -> dict:
    """Fresh matchers walk `tokens` together; per-step seconds of fill, apply and advance (means)."""
    matchers = lib.matchers(compiled, batch)
    bitmask = torch.zeros(batch, (vocab_size + 31) // 32, dtype=torch.int32)
    base = torch.randn(batch, vocab_size)
    logits = torch.empty_like(base)
    fill = apply = advance = 0.0
    for token in tokens:
        logits.copy_(base)
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        t1 = time.perf_counter()
        apply_token_bitmask(logits, bitmask)
        t2 = time.perf_counter()
        accepted = lib.accept(matchers, [token] * batch)
        t3 = time.perf_counter()
        fill, apply, advance = fill + t1 - t0, apply + t2 - t1, advance + t3 - t2
        assert all(accepted), f"{lib.name} rejected token {token}"
        assert logits[0, token] != float("-inf"), f"{lib.name} masked the document's token {token}"
    n = len(tokens)
    return {"fill_s": fill / n, "apply_s": apply / n, "advance_s": advance / n, "step_s": (fill + apply + advance) / n}


def bench_one(lib: Library, vocab: vocabs.Vocab, batches: list[int], repeats: int) -> dict:
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_str(vocab.tokenizer_json)
    setup_s = peers.timed(lambda: lib.setup(vocab))
    schema = json.dumps(SCHEMA)
    first_compile_s = peers.timed(lambda: lib.compile("json_schema", schema))
    compile_s = best_time(lambda: lib.compile("json_schema", schema), 3)
    compiled = lib.compile("json_schema", schema)
    tokens = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False).ids
    out = {"library": lib.name, "version": lib.version, "vocab": vocab.name, "vocab_size": vocab.vocab_size,
           "setup_s": setup_s, "first_compile_s": first_compile_s, "compile_s": compile_s,
           "document_tokens": len(tokens), "batches": {}}
    for batch in batches:
        walks = [walk(lib, compiled, tokens, batch, vocab.vocab_size) for _ in range(repeats)]
        out["batches"][str(batch)] = {key: statistics.median(w[key] for w in walks) for key in walks[0]} | {
            "first_step_s": walks[0]["step_s"]}
        log(f"{lib.name} {vocab.name} batch {batch}: {out['batches'][str(batch)]['step_s'] * 1e3:.3f} ms/step")
    out["features"] = probe(lib, vocab, tokenizer)
    return out


def decode_step(threads: int | None) -> dict:
    """Median batch-32 decode step of the `small` preset (128-token prompts), as bench.engine times it."""
    import random

    from bench.engine.ours import OursDecoder, random_prompt
    from engine import Engine, EngineArgs
    engine = Engine(EngineArgs("small", dtype="float32", num_blocks=32 * 12 + 8, max_num_seqs=32,
                               max_num_batched_tokens=4096, torch_threads=threads or 0))
    rng = random.Random(0)
    prompts = [random_prompt(rng, 128, engine.vocab_size) for _ in range(32)]
    decoder = OursDecoder(engine, prompts, 40)
    decoder.steps(2)
    times = [decoder.steps(6) for _ in range(3)]
    decoder.close()
    return {"batch": 32, "context": 128, "step_s": statistics.median(times), "vocab_size": engine.vocab_size,
            "attention": engine.attention}


def rows(result: dict) -> tuple[list[str], list[list[str]]]:
    step = result.get("decode_step", {}).get("step_s")
    head = ["library", "vocab", "set-up ms", "compile ms (first)", "B=1 step µs (fill/apply/advance)",
            "B=32 step ms (fill/apply/advance)", "B=32 / small decode step"]
    body = []
    for r in result["runs"]:
        b1, b32 = r["batches"].get("1"), r["batches"].get("32")
        cell1 = "" if b1 is None else (f"{b1['step_s'] * 1e6:.0f} ({b1['fill_s'] * 1e6:.0f}/{b1['apply_s'] * 1e6:.0f}/"
                                       f"{b1['advance_s'] * 1e6:.0f})")
        cell32 = "" if b32 is None else (f"{b32['step_s'] * 1e3:.2f} ({b32['fill_s'] * 1e3:.2f}/"
                                         f"{b32['apply_s'] * 1e3:.2f}/{b32['advance_s'] * 1e3:.2f})")
        share = f"{b32['step_s'] / step:.1%}" if b32 is not None and step else ""
        body.append([f"{r['library']} {r['version']}", f"{r['vocab']} ({r['vocab_size']})", f"{r['setup_s'] * 1e3:.0f}",
                     f"{r['compile_s'] * 1e3:.2f} ({r['first_compile_s'] * 1e3:.2f})", cell1, cell32, share])
    return head, body


def feature_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    seen: dict[str, dict] = {}
    for r in result["runs"]:
        seen.setdefault(f"{r['library']} {r['version']}", r["features"])
    return ["library"] + [p[0] for p in PROBES], [[name] + [f[p[0]] for p in PROBES] for name, f in seen.items()]


def title(result: dict) -> str:
    m = result["machine"]
    line = (f"grammar mask cost: nested JSON schema ({result['document_tokens']}), {result['threads']} threads, "
            f"torch {result['torch_version']}, load average {result['load_average_start']:.1f} -> "
            f"{result['load_average_end']:.1f}\nmachine: matmul {m['matmul']['flop_per_s'] / 1e9:.0f} GFLOP/s "
            f"(float32 GEMM {m['matmul']['size']}²), memcpy {m['memcpy']['bytes_per_s'] / 1e9:.1f} GB/s")
    d = result.get("decode_step")
    if d:
        line += (f"; small preset decode step, batch 32, context 128: {d['step_s'] * 1e3:.1f} ms "
                 f"({d['attention']} attention, vocab {d['vocab_size']})")
    return line


def main(argv: list[str] | None = None) -> int:
    from bench.engine.ours import load_average
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    load_start = load_average()
    log("machine limits: 1024² float32 GEMM, 256 MiB copy")
    machine = {"matmul": peers.matmul_flops(torch.float32, 1024, 5), "memcpy": peers.memcpy_bandwidth(256 << 20, 5)}
    batches = [int(b) for b in args.batches.split(",")]
    runs, doc_tokens = [], {}
    for name in args.vocabs.split(","):
        log(f"vocabulary {name}")
        vocab = vocabs.load(name)
        for lib_name in args.libraries.split(","):
            lib = LIBRARIES[lib_name](threads)
            try:
                runs.append(bench_one(lib, vocab, batches, args.repeats))
            except ImportError as e:
                log(f"{lib_name}: not installed ({e}); skipped")
                continue
            doc_tokens[name] = runs[-1]["document_tokens"]
    result = {"threads": threads, "torch_version": torch.__version__, "machine": machine, "runs": runs,
              "document_tokens": ", ".join(f"{v} tokens in {k}" for k, v in doc_tokens.items()),
              "load_average_start": load_start}
    if not args.no_decode_step:
        log("small preset: batch-32 decode step")
        result["decode_step"] = decode_step(args.threads)
    result["load_average_end"] = load_average()
    text = "\n\n".join([title(result), table(*rows(result)), table(*feature_rows(result))])
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n\n".join([title(result).replace("\n", "  \n"), markdown_table(*rows(result)),
                                 markdown_table(*feature_rows(result))]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
