"""Smoke tests of the layer-wise TTFT benchmarks on the tiny model: every figure is there and the
decode side's tokens equal the colocated engine's. No timing assertions (full runs: docs/benchmarks/transfer.md)."""
from __future__ import annotations

import json
import math

from bench.transfer import handoff_probe, ttft


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_ttft_bench_reports_every_figure_on_loopback(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "ttft.json"
    argv = ["--model", tiny_model_dir, "--lengths", "40", "--reps", "1", "--links", "loopback", "--json", str(out)]
    assert ttft.main(argv) == 0
    [row] = json.loads(out.read_text())
    assert row["link"] == "loopback" and row["length"] == 40 and row["tokens_equal"] is True
    for key in ("colocated", "disaggregated", "layerwise", "prefill_s", "prefill_layerwise_s", "handoff_s",
                "handoff_layerwise_s", "transfer_s"):
        assert _positive(row[key]), key
    assert math.isclose(row["target_s"], row["transfer_s"] / row["num_layers"] + 0.005)
    assert "loopback      40" in capsys.readouterr().out


def test_handoff_probe_measures_both_variants(tiny_model_dir):
    got = handoff_probe.probe("tcp", tiny_model_dir, 40, 1)
    assert set(got) == {True, False} and all(_positive(x) for pair in got.values() for x in pair)
