"""Serving-benchmark figures on a fixed, hand-made trace."""
from __future__ import annotations

import math

import pytest

from bench.serving.load import RequestRecord, arrival_gaps
from bench.serving.metrics import goodput, parse_counters, percentile, summarize
from bench.serving.workloads import describe, make_workload


def rec(i, ttft, e2e, n, ok=True, prompt=10, cached=0):
    r = RequestRecord(i, f"r{i}", "chat", prompt, n, ok=ok, num_output_tokens=n if ok else 0,
                      ttft_s=ttft, e2e_s=e2e, cached_prompt_tokens=cached)
    r.itl_s = [(e2e - ttft) / (n - 1)] * (n - 1) if ok and n > 1 else []
    return r


# SLO: TTFT ≤ 0.5 s, TPOT ≤ 0.05 s. Duration 4 s.
TRACE = [
    rec(0, 0.2, 1.2, 21),     # TPOT (1.2-0.2)/20 = 0.05   → meets both (boundary counts)
    rec(1, 0.6, 1.0, 11),     # TTFT 0.6 > 0.5             → misses
    rec(2, 0.1, 2.1, 11),     # TPOT 0.2 > 0.05            → misses
    rec(3, 0.3, 0.3, 1),      # one token: no TPOT         → meets
    rec(4, 0.0, 0.1, 0, ok=False),  # failed              → misses
    rec(5, 0.4, 0.8, 9, cached=10),  # TPOT 0.05           → meets
]


def test_goodput_matches_hand_computed_value():
    assert goodput(TRACE, 4.0, 0.5, 0.05) == pytest.approx(3 / 4.0)
    s = summarize(TRACE, 4.0, 0.5, 0.05)
    assert s["goodput_rps"] == pytest.approx(0.75)
    assert s["slo_attainment"] == pytest.approx(3 / 6)
    assert (s["completed"], s["failed"]) == (5, 1)
    assert s["throughput_tokens_s"] == pytest.approx((21 + 11 + 11 + 1 + 9) / 4.0)
    assert s["request_throughput_rps"] == pytest.approx(5 / 4.0)
    # TPOT excludes the first token and one-token requests: values 0.05, 0.04, 0.2, 0.05
    assert s["tpot_p50_s"] == pytest.approx(0.05)
    assert s["tpot_mean_s"] == pytest.approx((0.05 + 0.04 + 0.2 + 0.05) / 4)
    assert s["ttft_p50_s"] == pytest.approx(0.3)
    assert s["prefix_hit_rate"] == pytest.approx(10 / 50)
    assert s["itl_p99_s"] == pytest.approx(0.2)


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert math.isnan(percentile([], 50))


def test_parse_counters_sums_label_sets():
    text = ('pdserve_kv_transfer_bytes_total{codec="fp8"} 100.0\npdserve_kv_transfer_bytes_total{codec="none"} 5.0\n'
            'pdserve_kv_wire_bytes_total 30.0\n# HELP x\npdserve_kv_wire_bytes_created 1.7e9\n')
    c = parse_counters(text)
    assert c["kv_bytes"] == 105.0 and c["kv_wire_bytes"] == 30.0 and c["local_prefills"] == 0.0


def test_workloads_are_deterministic_and_shaped():
    a, b = make_workload("mixed", 20, seed=3, scale=0.5), make_workload("mixed", 20, seed=3, scale=0.5)
    assert [s.prompt_token_ids for s in a] == [s.prompt_token_ids for s in b]
    assert {s.kind for s in a} == {"chat", "rag"}
    shared = make_workload("shared-prefix", 3, scale=0.1)
    n = round(1024 * 0.1)
    assert shared[0].prompt_token_ids[:n] == shared[2].prompt_token_ids[:n]
    d = describe(make_workload("rag", 10, output_len=7))
    assert d["output_len"]["min"] == d["output_len"]["max"] == 7


def test_a_seed_draws_the_prompts_it_always_drew():
    """Prompt ids are the draws of ``randrange(*TOKEN_ID_RANGE)`` in order: a seed's workload (and every
    figure recorded with it) stays the same."""
    import random

    from bench.serving.workloads import SHAPES, TOKEN_ID_RANGE
    rng = random.Random("rag-5")
    expected = []
    for _ in range(3):
        ids = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(rng.randint(*SHAPES["rag"][:2]))]
        expected.append((ids, rng.randint(*SHAPES["rag"][2:])))
    assert [(s.prompt_token_ids, s.output_len) for s in make_workload("rag", 3, seed=5)] == expected


def test_poisson_gaps_have_the_requested_rate():
    gaps = arrival_gaps(4000, 5.0, 1.0, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.2, rel=0.05)
    assert arrival_gaps(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


def test_jsonl_workload(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "hello", "output_len": 3}\n\n{"prompt_len": 5, "output_len": 2}\n')
    specs = make_workload(str(path), 3)
    assert [(s.prompt, s.prompt_len, s.output_len) for s in specs][0] == ("hello", 5, 3)
    assert specs[1].prompt_token_ids is not None and specs[1].prompt_len == 5 and specs[2].prompt == "hello"
    path.write_text('{"prompt_len": 5}\n')
    with pytest.raises(ValueError, match="w.jsonl:1"):
        make_workload(str(path), 1)


def test_scrape_presents_the_token_a_protected_metrics_endpoint_asks_for():
    from bench.serving.metrics import scrape
    from router.metrics import Metrics
    metrics = Metrics()
    port = metrics.serve("127.0.0.1", 0, token="s3cret")
    try:
        metrics.kv_transfer(0.01, 4096, 1024, "fp8")
        url = f"http://127.0.0.1:{port}/metrics"
        assert scrape(url) is None                     # 401 without the token
        counters = scrape(url, "s3cret")
        assert counters["kv_bytes"] == 4096 and counters["kv_wire_bytes"] == 1024
    finally:
        metrics.stop()
