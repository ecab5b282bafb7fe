"""Smoke test of the engine benchmark: it runs end to end on `tiny` and reports every figure.

No timing assertions: speed goals live in the benchmark's own PASS/MISS table.
"""
from __future__ import annotations

import json
import math

from bench import engine as bench_engine
from bench.engine.report import TARGETS

PREFILL_KEYS = {"tokens", "ours_s", "hf_s", "ratio", "ours_tokens_per_s", "hf_tokens_per_s", "flops",
                "ours_flop_per_s", "hf_flop_per_s"}
DECODE_KEYS = {"ours_s", "hf_s", "ratio", "context", "step_bytes", "ours_bytes_per_s", "hf_bytes_per_s",
               "ours_tokens_per_s", "hf_tokens_per_s"}
WORKLOAD_KEYS = {"num_requests", "useful_tokens", "hf_generated_tokens", "ours_s", "hf_s", "ours_tokens_per_s",
                 "hf_tokens_per_s", "speedup", "identical_outputs"}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_engine_quick_tiny_reports_every_figure(tmp_path, tiny_model_dir, capsys):
    out, md = tmp_path / "engine.json", tmp_path / "engine.md"
    assert bench_engine.main(["--model", "tiny", "--quick", "--json", str(out), "--markdown", str(md)]) == 0
    r = json.loads(out.read_text())

    assert r["model"] == "tiny" and r["dtype"] == "float32" and r["quick"] is True
    assert _positive(r["machine"]["matmul"]["flop_per_s"]) and _positive(r["machine"]["memcpy"]["bytes_per_s"])
    assert set(r["prefill"]) == {"512", "2048"}
    for p in r["prefill"].values():
        assert PREFILL_KEYS <= set(p) and all(_positive(p[k]) for k in PREFILL_KEYS)
    assert set(r["decode"]) == {"1", "8", "32"}
    for d in r["decode"].values():
        assert DECODE_KEYS <= set(d) and all(_positive(d[k]) for k in DECODE_KEYS)
    w = r["workload"]
    assert WORKLOAD_KEYS - {"identical_outputs"} <= set(w)
    assert all(_positive(w[k]) for k in WORKLOAD_KEYS - {"identical_outputs"})
    assert w["useful_tokens"] <= w["hf_generated_tokens"]
    assert 0 <= w["identical_outputs"] <= w["num_requests"]

    assert [t["target"] for t in r["targets"]] == [name for name, *_ in TARGETS]
    assert all(isinstance(t["pass"], bool) and math.isfinite(t["value"]) for t in r["targets"])
    printed = capsys.readouterr().out
    assert printed.count("PASS") + printed.count("MISS") == len(TARGETS)
    assert md.read_text().count("| ") > len(TARGETS)


def test_bench_engine_quantization_tiny_reports_each_engine(tmp_path, tiny_model_dir, capsys):
    """--quantization: one engine per quantization side by side (no HF); `none` is added when left out."""
    out, md = tmp_path / "quant.json", tmp_path / "quant.md"
    assert bench_engine.main(["--model", "tiny", "--quick", "--quantization", "int8,int4,int4+head", "--group-size",
                              "64", "--json", str(out), "--markdown", str(md)]) == 0
    r = json.loads(out.read_text())
    assert list(r["runs"]) == ["none", "int8", "int4", "int4+head"] and r["group_size"] == 64
    none, int8, int4, head = (r["runs"][q] for q in ("none", "int8", "int4", "int4+head"))
    assert none["plan"] is None and int4["plan"].startswith("int4 group 64: packed kernel")
    assert head["weight_bytes"] < int4["weight_bytes"] < int8["weight_bytes"] < none["weight_bytes"]
    for run in r["runs"].values():
        assert set(run["prefill"]) == {"512", "2048"} and set(run["decode"]) == {"1", "8", "32"}
        assert all(_positive(d["s"]) and _positive(d["bytes_per_s"]) for d in run["decode"].values())
    names = [t["target"] for t in r["targets"]]
    assert names[:3] == ["int8 decode batch 1: step vs none", "int8 prefill 512: time vs none",
                         "int8 prefill 2048: time vs none"] and len(names) == 9
    assert names[-3] == "int4+head decode batch 1: step vs none"
    printed = capsys.readouterr().out
    assert printed.count("PASS") + printed.count("MISS") == 9 and md.read_text().count("| ") > 9
