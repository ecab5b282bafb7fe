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
