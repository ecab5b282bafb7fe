"""Smoke test of `pdserve bench spec`: every figure is reported, and its workload file reads back.

No timing assertions: speed goals live in the benchmark's own table (docs/benchmarks/spec.md).
"""
from __future__ import annotations

import json
import math

from bench import spec
from bench.serving.workloads import make_workload


def test_spec_bench_reports_rate_acceptance_and_speedup_per_method():
    rows = spec.measure(batches=(2,), temperatures=(0.0,), methods=("ngram",), max_tokens=6, repeats=1, warmup=1)
    assert [(r["workload"], r["batch"], r["temperature"]) for r in rows] == [("heldout", 2, 0.0), ("quote", 2, 0.0)]
    for r in rows:
        assert r["off"] > 0 and r["ngram"] > 0 and math.isclose(r["ngram_speedup"], r["ngram"] / r["off"])
        assert math.isnan(r["ngram_acceptance"]) or 0.0 <= r["ngram_acceptance"] <= 1.0
    table = spec.markdown(rows, ("ngram",))
    assert table.count("\n") == 2 + len(rows) and "ngram speedup" in table


def test_the_quote_workload_file_is_a_serving_workload(tmp_path):
    path = tmp_path / "quote.jsonl"
    assert spec.main(["--write-workload", str(path), "--max-tokens", "12"]) == 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 64 and all(set(r) == {"prompt", "output_len"} and r["output_len"] == 12 for r in lines)
    specs = make_workload(str(path), num_requests=8, seed=0)
    assert len(specs) == 8 and all(s.prompt and s.output_len == 12 for s in specs)
