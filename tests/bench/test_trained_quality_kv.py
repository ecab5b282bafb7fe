"""The KV codec gate of `python -m bench.trained_quality` (docs/benchmarks/transfer.md, "KV codec quality"):
varied prompt lengths, the codecs side by side with their bytes per token, forks and bits per byte, the
gate's verdict, and the JSON the docs link."""
from __future__ import annotations

import json

import pytest
import torch

from bench.trained_quality import KV_GATE, main, varied_prompt_lens


def test_varied_prompt_lengths_are_distinct_and_mostly_end_inside_a_block():
    lens = varied_prompt_lens(64)
    assert len(set(lens)) == 64 and min(lens) >= 17 and max(lens) <= 128
    inside = sum(n % 16 != 0 for n in lens)
    assert 0 < 64 - inside < inside                   # some end on a block boundary, most inside one
    assert varied_prompt_lens(64) == lens and varied_prompt_lens(8) == lens[:8]


def test_cli_prints_both_codecs_side_by_side_and_writes_the_gate(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_COMPILE", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = tmp_path / "gate.json"
        code = main(["--no-bpb", "--weights", "", "--passages", "2", "--attention", "eager", "--transport", "fake",
                     "--kv-codecs", "fp8,int8", "--varied-prompts", "--no-bf16-ref", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    q = json.loads(path.read_text())["kv"]
    assert set(q) >= {"none", "fp8", "int8"} and "bf16_ref" not in q and q["gate"] == KV_GATE
    assert q["prompt_lens"] == varied_prompt_lens(2) and q["prompt_tokens"] is None
    assert code == (0 if q["fp8"]["gate_pass"] else 1)             # the exit status follows the default codec
    # float32 pydoc: 4 layers x 2 (K/V) x 2 heads x 64 values a token
    assert q["none"]["bytes_per_token"] == 4 * 2 * 2 * 64 * 4
    assert q["fp8"]["bytes_per_token"] == pytest.approx(1024 + 4 * 16 / 16)
    assert q["int8"]["bytes_per_token"] == 1024 + 4 * 16
    for name in ("fp8", "int8"):
        row = q[name]
        assert row["num_forks"] == len(row["margins_at_forks"]) and row["max_margin_at_fork"] == \
            max(row["margins_at_forks"], default=0.0)
        assert row["bits_per_byte"] == pytest.approx(q["none"]["bits_per_byte"] * (1 + row["bpb_rel_diff"]))
        line = next(x for x in out.splitlines() if x.startswith(name + " "))
        assert f"{row['bytes_per_token']:.0f}" in line and ("pass" in line or "FAIL" in line)
        assert f"{name}: gate " in out
