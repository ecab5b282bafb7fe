"""`make gpu-check` on a machine without CUDA: it skips cleanly; its helpers and checks work on CPU.

The checks themselves run on the device `bench.gpu_check.DEVICE` names; here on "cpu" at toy sizes,
so a renamed engine or transport API fails here, not first on a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from bench.gpu_check import Row, clear_prefix, datasheet, format_table, greedy_agreement, prefix_agreement

REPO = Path(__file__).resolve().parents[2]


def test_without_cuda_it_says_skipped_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "build" / "gpu-check.json"      # as `make gpu-check` on a fresh checkout: no build/ yet
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--json", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "gpu-check skipped: no CUDA device"
    assert json.loads(out.read_text()) == {"skipped": "no CUDA device"}


def test_makefile_target_runs_the_module():
    makefile = (REPO / "Makefile").read_text()
    assert "\ngpu-check:" in makefile and "-m bench.gpu_check" in makefile


def test_clear_prefix_stops_at_the_first_near_tie():
    assert clear_prefix([1.0, 0.5, 0.1, 2.0], margin=0.25) == 2
    assert clear_prefix([1.0, 0.5], margin=0.25) == 2
    assert clear_prefix([0.25, 1.0], margin=0.25) == 0      # equal to the margin is not clear
    assert clear_prefix([], margin=0.25) == 0


def test_greedy_agreement_compares_only_clear_steps():
    hf = [[5, 6, 7], [1, 2, 3]]
    gaps = [[1.0, 1.0, 0.01], [1.0, 0.01, 1.0]]
    same_where_clear = [[5, 6, 9], [1, 8, 8]]               # differences only after a near-tie
    a = greedy_agreement(same_where_clear, hf, gaps, margin=0.25)
    assert a == {"prompts": 2, "clear_tokens": 3, "total_tokens": 6, "mismatched_prompts": 0, "first_mismatch": None}
    b = greedy_agreement([[5, 4, 7], [1, 2, 3]], hf, gaps, margin=0.25)
    assert b["mismatched_prompts"] == 1 and b["first_mismatch"] == {"prompt": 0, "step": 1, "ours": 4, "hf": 6}


def test_prefix_agreement():
    assert prefix_agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == 1.0
    assert prefix_agreement([[1, 9, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == 3 / 5
    assert prefix_agreement([], []) == 0.0


def test_datasheet_and_table():
    assert datasheet("NVIDIA H200") == (989e12, 4.8e12)
    assert datasheet("NVIDIA H100 80GB HBM3")[1] == 3.35e12
    assert datasheet("Tesla T4") is None
    table = format_table([Row("a check", "ok", "1.0 GB/s", "peer 2.0"), Row("b", "FAIL", "x")]).splitlines()
    assert table[0].split() == ["check", "status", "figure", "peer"] and set(table[1]) <= {"-", " "}
    assert table[2].startswith("a check  ok ") and table[3].split() == ["b", "FAIL", "x"]


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "DECODE_POINT", (4, 64))
    monkeypatch.setattr(gpu_check, "PREFILL_POINT", (2, 64))


def test_engine_vs_hf_check_runs_on_cpu(on_cpu):
    pytest.importorskip("transformers")
    from engine.model.presets import resolve_model
    rows = gpu_check.check_engine_vs_hf(resolve_model("tiny"), prompts=3, new_tokens=4)
    assert [r.check for r in rows] == ["engine vs HF logits (bf16)", "engine vs HF greedy (bf16)"]
    assert rows[0].status == "ok", rows[0]
    assert rows[1].data["total_tokens"] == 12 and rows[1].data["mismatched_prompts"] == 0, rows[1]


def test_speed_and_transfer_checks_run_on_cpu(on_cpu):
    from engine.model.presets import resolve_model
    peaks = {"copy_bytes_per_s": 1e10, "matmul_flops_per_s": 1e11}
    rows = gpu_check.check_speed(resolve_model("tiny"), peaks)
    assert [r.check for r in rows] == ["KV budget from the device", "decode step bytes/s (4 × 64 ctx)",
                                       "prefill FLOP/s (2 × 64)"]
    assert rows[1].data["bytes_per_s"] > 0 and rows[2].data["flops_per_s"] > 0
    rows = gpu_check.check_transfer(1)
    assert [r.check for r in rows] == ["KV transfer GPU→GPU grpc none", "KV transfer GPU→GPU grpc fp8",
                                       "KV transfer GPU→GPU grpc int8"]
    assert all(r.data["gb_per_s"] > 0 and r.data["bytes"] == 1 << 20 for r in rows)


def test_tensor_parallel_check_runs_on_cpu(on_cpu):
    """On CPU both ranks run over gloo as on a one-GPU machine: the row must say the outputs agree."""
    from engine.model.presets import resolve_model
    rows = gpu_check.check_tensor_parallel(resolve_model("tiny"), new_tokens=4)
    assert [r.check for r in rows] == ["tensor parallel 2 vs 1 rank (1 GPU shared by both ranks, gloo)"]
    assert rows[0].status == "ok" and rows[0].data["equal_outputs"] == 3, rows[0]


def test_flex_check_runs_on_cpu(on_cpu, monkeypatch):
    """The flex rows through flex's reference math (compiled flex is CUDA-only), graphs without capture."""
    from engine.model.presets import resolve_model
    monkeypatch.setattr(gpu_check, "FLEX_MODE", "flex-eager")
    monkeypatch.setattr(gpu_check, "FLEX_NUM_BLOCKS", 48)
    monkeypatch.setattr(gpu_check, "FLEX_PROMPT_LENS", (20, 5))
    monkeypatch.setattr(gpu_check, "FLEX_NEW_TOKENS", 3)
    monkeypatch.setattr(gpu_check, "FLEX_REPEATS", 1)
    rows = gpu_check.check_flex(resolve_model("tiny"), resolve_model("tiny"))
    assert [r.check for r in rows] == ["flex paged attention vs eager (fp32)", "flex + decode graphs vs eager (fp32)",
                                       "decode step flex (4 × 64 ctx)", "decode step flex + graphs (4 × 64 ctx)",
                                       "prefill flex (2 × 64)"]
    assert rows[0].status == rows[1].status == "ok", rows[:2]
    assert rows[1].data["graphs"] and all(r.data["seconds"] > 0 for r in rows[2:])


def test_quantized_check_runs_on_cpu(on_cpu, monkeypatch):
    """Both schemes' products within tolerance of their dequantized weights; a decode row per scheme and batch."""
    from engine.model.presets import resolve_model
    monkeypatch.setattr(gpu_check, "FLEX_NUM_BLOCKS", 48)
    rows = gpu_check.check_quantized(resolve_model("tiny"))
    decode = [f"decode step {s} weights ({b} × 64 ctx)" for s in ("int8", "int4") for b in (1, 4)]
    assert [r.check for r in rows] == ["int8 projection vs dequantized (bf16)",
                                       "int4 projection vs dequantized (bf16)", *decode]
    assert rows[0].status == rows[1].status == "ok", rows[:2]
    assert all(0 < e <= gpu_check.QUANT_RTOL for r in rows[:2] for e in r.data["rel_err"].values())
    assert all(r.data["seconds"] > 0 and r.data["bf16"] > 0 for r in rows[2:])


def test_kv_cache_dtype_check_runs_on_cpu(on_cpu, monkeypatch):
    """Attention over each quantized cache (the gather path, then the compiled kernel) within tolerance of its
    dequantized copy; a decode row per dtype."""
    from engine.model.presets import resolve_model
    monkeypatch.setattr(gpu_check, "FLEX_NUM_BLOCKS", 48)
    rows = gpu_check.check_kv_cache_dtype(resolve_model("tiny"))
    assert [r.check for r in rows] == [*(f"{k} KV cache {what} vs dequantized" for k in ("fp8", "int8")
                                         for what in ("attention", "compiled decode kernel")),
                                       *(f"decode step {k} KV cache (4 × 64 ctx)" for k in ("fp8", "int8"))]
    assert all(r.status == "ok" for r in rows[:4]), rows[:4]
    assert all(r.data["seconds"] > 0 and r.data["bf16"]["seconds"] > 0 for r in rows[4:])


def test_kv_tiers_check_runs_on_cpu(on_cpu):
    """The host tier round trip passes (bit-exact blocks, equal tokens); the onboarding row beside a copy."""
    from engine.model.presets import resolve_model
    rows = gpu_check.check_kv_tiers(resolve_model("tiny"))
    assert [r.check for r in rows] == ["KV host tier: offload → evict → onboard", "KV host tier onboarding"]
    assert rows[0].status == "ok" and "144 cached tokens, blocks bit-exact" in rows[0].figure, rows[0]
    assert rows[0].data["stats"]["num_hits"] == 9


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the driver")
def test_a_failing_check_is_a_row(on_cpu, monkeypatch):
    """run_checks never stops at a failing check: it becomes an error row, the rest still run."""
    def broken(*_):
        raise RuntimeError("no such thing")
    for name in ("device_peaks", "check_engine_vs_hf", "check_speed", "check_flex", "check_quantized",
                 "check_kv_cache_dtype", "check_kv_tiers", "check_tensor_parallel", "check_transfer",
                 "check_nixl_transfer", "check_cluster", "check_gpu_tests"):
        monkeypatch.setattr(gpu_check, name, broken)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "stub")
    rows, info = gpu_check.run_checks(gpu_check.build_parser().parse_args(["--model", "tiny", "--perf-model", "x"]))
    assert [r.status for r in rows] == ["error"] * 12
    assert rows[0].figure == "RuntimeError: no such thing" and info["device"] == "stub"
