"""`bench.serving.slo_scale`: per-class SLOs, max rate at 90% attainment, the phases report."""
from __future__ import annotations

import pytest

from bench.serving.cluster import VARIANTS, bench_config, variants_of
from bench.serving.load import RequestRecord
from bench.serving.metrics import summarize
from bench.serving.slo_scale import max_rate_rps, phase_report, rates_around
from bench.serving.workloads import make_workload


def rec(i, kind, ttft, e2e, n):
    return RequestRecord(i, f"r{i}", kind, 10, n, ok=True, num_output_tokens=n, ttft_s=ttft, e2e_s=e2e)


def test_class_slos_hold_each_request_to_its_own_class():
    slos = {"chat": {"ttft_s": 0.2, "tpot_s": 0.05}, "rag": {"ttft_s": 2.0, "tpot_s": 0.1}}
    trace = [rec(0, "chat", 0.1, 0.6, 11),      # TPOT 0.05: meets chat's
             rec(1, "chat", 0.5, 0.6, 11),      # TTFT 0.5 > 0.2: misses chat's (rag's would hold)
             rec(2, "rag", 1.5, 2.4, 10),       # TPOT 0.1, TTFT 1.5: meets rag's
             rec(3, "rag", 2.5, 2.6, 2)]        # TTFT 2.5 > 2.0: misses
    s = summarize(trace, 2.0, 0.3, 0.05, class_slos=slos)
    assert s["slo_attainment"] == pytest.approx(2 / 4) and s["goodput_rps"] == pytest.approx(1.0)
    fixed = summarize(trace, 2.0, 0.3, 0.05)       # one pair for all: only request 0 meets it
    assert fixed["slo_attainment"] == pytest.approx(1 / 4)


def test_max_rate_interpolates_the_90_percent_crossing():
    points = [{"x": 1.0, "slo_attainment": 1.0}, {"x": 2.0, "slo_attainment": 0.95},
              {"x": 3.0, "slo_attainment": 0.75}, {"x": 4.0, "slo_attainment": 0.95}]
    # between (2, 0.95) and (3, 0.75): 2 + 0.05 / 0.2 = 2.25; the later recovery does not count
    assert max_rate_rps(points) == {"max_rate_rps": pytest.approx(2.25), "bounded": True}
    assert max_rate_rps(points[:2]) == {"max_rate_rps": 2.0, "bounded": False}
    # even the lowest rate misses: from (0, 100%) to (1, 50%) → 0.2
    assert max_rate_rps([{"x": 1.0, "slo_attainment": 0.5}])["max_rate_rps"] == pytest.approx(0.2)
    assert rates_around(2.0) == [0.5, 1.0, 1.5, 2.0, 2.5]


def test_phases_workload_and_report():
    specs = make_workload("phases", 9, seed=1)
    assert [s.kind for s in specs] == ["chat"] * 3 + ["rag"] * 3 + ["chat"] * 3
    records = [{"sent_at": float(i * 10), "kind": s.kind, "meets_slo": i != 4} for i, s in enumerate(specs)]
    roles = [{"t": float(t), "prefill": p, "decode": 4 - p, "colocated": 0}
             for t, p in [(0, 1), (20, 1), (35, 2), (40, 3), (50, 2), (55, 3), (65, 2), (75, 1), (85, 1)]]
    report = phase_report(records, roles, window_s=30.0)
    assert report["shifts_s"] == [30.0, 60.0]
    first, rag, chat = report["phases"]
    assert (first["num_changes"], first["prefill_actors"]) == (0, 1)
    # rag from 30 s: 1→2 (35), →3 (40), →2 (50), →3 (55): settled 25 s in, two reversals
    assert (rag["num_changes"], rag["settled_after_s"], rag["reversals"], rag["prefill_actors"]) == (4, 25.0, 2, 3)
    assert (chat["num_changes"], chat["settled_after_s"], chat["reversals"]) == (2, 15.0, 0)
    assert report["attainment"] == [(15.0, 1.0), (45.0, pytest.approx(2 / 3)), (75.0, 1.0)]


def test_the_auto_variant_is_disaggregated_with_auto_placement():
    assert variants_of("colocated,disaggregated,auto", "disaggregated") == [
        "colocated", "colocated-chunked", "disaggregated", "auto"]
    assert VARIANTS["auto"] == ("disaggregated", True)
    auto = bench_config(None, "tiny", None, [], "auto").routing
    assert (auto.mode, auto.role_flips) == ("auto", "auto")
    assert bench_config(None, "tiny", None, ["routing.role_flips=off"], "auto").routing.role_flips == "off"
    assert bench_config(None, "tiny", None, [], "disaggregated").routing.mode == "disaggregated"


def test_the_spec_variants_add_ngram_speculation_to_their_plain_peers():
    assert variants_of("disaggregated,disaggregated-spec,colocated-spec", "disaggregated") == [
        "disaggregated", "disaggregated-spec", "colocated-spec"]
    assert VARIANTS["colocated-spec"] == VARIANTS["colocated-chunked"]
    assert bench_config(None, "tiny", None, [], "disaggregated-spec").speculative.method == "ngram"
    assert bench_config(None, "tiny", None, [], "disaggregated").speculative.method == "off"
    with pytest.raises(ValueError, match="unknown variant 'eagle'"):
        variants_of("eagle", "disaggregated")
