"""Sweep plots, side-by-side tables and the benchmarks page render from fixed results (no cluster)."""
from __future__ import annotations

import pytest

from bench.report.markdown import render_markdown
from bench.serving.load import RequestRecord
from bench.serving.metrics import summarize
from bench.serving.plots import plot_latency_sweep, plot_slo_attainment
from bench.serving.sweep import FIGURES
from bench.serving.tables import max_rate_at_attainment, table, targets
from bench.serving.workloads import describe, make_workload


def run(ttft: float, e2e: float) -> dict:
    records = [RequestRecord(i, f"r{i}", "chat", 10, 11, ok=True, num_output_tokens=11, ttft_s=ttft, e2e_s=e2e,
                             itl_s=[(e2e - ttft) / 10] * 10) for i in range(4)]
    return summarize(records, 2.0, 0.5, 0.05)


RUNS = {"colocated": run(0.1, 1.1), "colocated-chunked": run(0.2, 0.7), "disaggregated": run(0.12, 0.42)}


def test_targets_and_ratio_table():
    checks = dict((s, (v, ok)) for s, v, ok in targets(RUNS, RUNS))
    assert checks["disaggregated p99 TPOT ≤ 0.5× colocated (no chunking)"] == ("0.30×", True)
    per_run = [k for k in checks if k.startswith("disaggregated goodput") and "per run" in k]
    assert len(per_run) == 1 and checks[per_run[0]][1] is False   # 2.0 vs 2.0
    assert checks["low-load p50 TTFT ≤ 1.3× colocated"] == ("1.20×", True)
    text = table(RUNS, ratio_of="disaggregated", markdown=True)
    assert "| TPOT p99 (ms) | 100.0 | 50.0 | 30.0 | 0.30× | 0.60× |" in text


def test_distserve_goodput_is_the_highest_rate_held():
    def curve(*pairs):
        return [{"x": x, "slo_attainment": a} for x, a in pairs]
    # 90% is crossed a quarter of the way from 4 (100%) to 6 (60%): 4.5 req/s
    assert max_rate_at_attainment(curve((2, 1.0), (4, 1.0), (6, 0.6))) == (4.5, "")
    assert max_rate_at_attainment(curve((6, 0.95), (2, 1.0))) == (6, ">=")        # held at every rate
    assert max_rate_at_attainment(curve((2, 0.5), (4, 0.2))) == (2, "<")          # held at none
    rates = {"colocated": curve((2, 1.0), (4, 0.8)), "colocated-chunked": curve((2, 1.0), (4, 0.5)),
             "disaggregated": curve((2, 1.0), (4, 1.0), (6, 0.6))}
    checks = {s: (v, ok) for s, v, ok in targets(RUNS, RUNS, rates)}
    (key,) = [k for k in checks if "DistServe" in k]
    assert checks[key] == ("1.50×", True) and "colocated 3.00" in key    # 4.5 vs 3.0


def test_plots_and_page(tmp_path):
    points = {v: [{"x": x, **{k: r[k] for k in FIGURES}} for x in (1, 2, 4)] for v, r in RUNS.items()}
    paths = {"rate": plot_slo_attainment(points, str(tmp_path / "rate.png"), "t"),
             "concurrency": plot_latency_sweep(points, "concurrency", str(tmp_path / "c.png"), "t")}
    for path in paths.values():
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    from bench.report.suite import PRESETS
    from dataclasses import asdict
    result = {"plan": asdict(PRESETS["tiny"]), "low_load": RUNS, "loaded": RUNS, "rates": points, "prefix": {},
              "sweeps": {"concurrency": points}, "throughput": {"disaggregated": RUNS["disaggregated"]},
              "workloads": {"mixed": describe(make_workload("mixed", 8, scale=0.1))}, "wall_s": 60.0,
              "machine": {"cpu": "cpu", "cores": 2, "memory_gib": 1, "os": "os", "python": "3", "torch": "t",
                          "ray": "r", "grpcio": "g", "transformers": "x", "commit": "c", "load_before": [1, 1, 1]}}
    page = render_markdown(result, {"rate": "img/rate.png", "concurrency": "img/c.png"})
    assert "![SLO attainment vs rate](img/rate.png)" in page and "### Targets" in page
    assert ("| disaggregated goodput ≥ 1.3× the better colocated variant (per run, requests/s meeting both SLOs "
            "at the loaded rate) | 1.00× | **not met** |") in page


def test_the_suite_report_keeps_the_chaos_section(tmp_path):
    from bench.report.suite import kept_sections
    page = tmp_path / "benchmarks.md"
    assert kept_sections(str(page)) == ""
    page.write_text("# Benchmarks\n\n## Serving\nold figures\n\n## Chaos run\n\nchaos figures\n")
    assert kept_sections(str(page)) == "\n## Chaos run\n\nchaos figures\n"


@pytest.mark.parametrize("flags, named", [
    (["--request-rate", "nan"], "--request-rate"), (["--num-requests", "0"], "--num-requests"),
    (["--scale", "-1"], "--scale"), (["--concurrency", "0"], "--concurrency"),
    (["--json", "/no/such/dir/out.json"], "--json")])
def test_bench_serve_refuses_a_bad_flag_naming_it(flags, named, capsys):
    from bench.serving import cli
    with pytest.raises(SystemExit) as refused:
        cli.main(["--embedded", *flags])
    assert refused.value.code == 2
    assert f"argument {named}" in capsys.readouterr().err


def test_make_workload_refuses_what_no_run_could_serve(tmp_path):
    from bench.serving.workloads import make_workload
    with pytest.raises(ValueError, match="--num-requests"):
        make_workload("chat", 0)
    with pytest.raises(ValueError, match="--scale"):
        make_workload("chat", 2, scale=float("nan"))
    with pytest.raises(ValueError, match="--output-len"):
        make_workload("chat", 2, output_len=0)
    with pytest.raises(ValueError, match="cannot read it"):
        make_workload(str(tmp_path / "none.jsonl"), 2)
