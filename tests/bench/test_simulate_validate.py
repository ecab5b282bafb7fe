"""The validation against measured runs: repeated measurements give each figure's median and range, and
the report counts the simulated figures inside that range."""
from __future__ import annotations

import argparse

from bench.simulate import validate


def figures(scale: float, attainment: float = 1.0) -> dict:
    point = {k: scale * (i + 1) / 100 for i, k in enumerate(validate.FIGURES)}
    return {v: {**point, "slo_attainment": attainment, "goodput_rps": scale} for v in validate.VARIANTS}


def test_repeated_measurements_give_the_median_and_the_range(monkeypatch):
    runs = iter([figures(1.0), figures(3.0, 0.8), figures(2.0)])
    monkeypatch.setattr(validate, "measured", lambda args, workload, rate: next(runs))
    out = validate.measured_repeats(argparse.Namespace(repeats=3), "chat", 1.0)
    for v in validate.VARIANTS:
        assert out[v]["tpot_p50_s"] == figures(2.0)[v]["tpot_p50_s"]           # the median run's figure
        assert out[v]["slo_attainment"] == 1.0
        lo, hi = out["range"][v]["ttft_p50_s"]
        assert (lo, hi) == (figures(1.0)[v]["ttft_p50_s"], figures(3.0)[v]["ttft_p50_s"])
    assert len(out["runs"]) == 3


def test_one_measurement_is_taken_as_it_is(monkeypatch):
    monkeypatch.setattr(validate, "measured", lambda args, workload, rate: figures(1.0))
    out = validate.measured_repeats(argparse.Namespace(repeats=1), "chat", 1.0)
    assert out == figures(1.0)


def test_the_report_counts_simulated_figures_inside_the_measured_range(monkeypatch, capsys):
    runs = iter([figures(1.0), figures(3.0)])
    monkeypatch.setattr(validate, "measured", lambda args, workload, rate: next(runs))
    measured = validate.measured_repeats(argparse.Namespace(repeats=2), "chat", 1.0)
    simulated = figures(2.5)
    simulated["auto"] = figures(4.0)["auto"]                                      # outside on every figure
    points = [{"rate": 1.0, "measured": measured, "simulated": simulated}]
    held = {side: {v: {"max_rate_rps": 1.0} for v in validate.VARIANTS} for side in ("measured", "simulated")}
    validate.print_workload("chat", points, held)
    inside = 2 * len(validate.FIGURES)
    assert f"inside the range of the repeated measured runs: {inside} of {3 * len(validate.FIGURES)}" in \
        capsys.readouterr().out


def test_a_figure_missing_from_a_run_is_left_out_of_its_median(monkeypatch):
    missing = figures(5.0)
    for v in validate.VARIANTS:
        missing[v]["ttft_p90_s"] = None                     # (no request completed in that run, say)
    runs = iter([figures(1.0), missing, figures(3.0)])
    monkeypatch.setattr(validate, "measured", lambda args, workload, rate: next(runs))
    out = validate.measured_repeats(argparse.Namespace(repeats=3), "chat", 1.0)
    v = validate.VARIANTS[0]
    assert out[v]["ttft_p90_s"] == (figures(1.0)[v]["ttft_p90_s"] + figures(3.0)[v]["ttft_p90_s"]) / 2
    assert out["range"][v]["ttft_p90_s"] == [figures(1.0)[v]["ttft_p90_s"], figures(3.0)[v]["ttft_p90_s"]]


def test_the_stage_table_sets_each_sides_timeline_side_by_side(capsys):
    def side(compute_ms: float, transit_ms: float) -> dict:
        stages = dict.fromkeys(validate.STAGES, 0.0)
        stages.update(timeline_prefill_compute_s_mean=compute_ms / 1e3, timeline_transit_s_mean=transit_ms / 1e3)
        return {v: {**figures(1.0)[v], **stages} for v in validate.VARIANTS}
    points = [{"rate": 1.5, "measured": side(74.0, 3.6), "simulated": side(30.0, 17.7)},
              {"rate": 3.0, "measured": side(80.0, 0.2), "simulated": side(31.0, 0.1)}]
    validate.print_stages(points)
    out = capsys.readouterr().out
    assert "| stage | 1.5 req/s | 3 req/s |" in out
    assert "| prefill compute (prefill) | 74.0 / 30.0 | 80.0 / 31.0 |" in out
    assert "| transit (router) | 3.6 / 17.7 | 0.2 / 0.1 |" in out
    assert "adopt" not in out and "intake" not in out                 # under 0.5 ms on both sides: left out
    validate.print_stages([{"rate": 1.5, "measured": figures(1.0), "simulated": side(30.0, 17.7)}])
    assert capsys.readouterr().out == ""                                # measured before stages were kept
