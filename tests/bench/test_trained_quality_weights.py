"""Gate: weight-only int8 / int4 on the trained model keep held-out bits per byte within 1% / 5% of the
unquantized weights, on a few of the fixed held-out passages (full figures: `python -m
bench.trained_quality`, docs/benchmarks/engine.md "Weight-only quantization")."""
from __future__ import annotations

import pytest
import torch

from bench.trained_quality import WEIGHT_TARGETS, weight_quality

NUM_PASSAGES = 8


@pytest.fixture(scope="module")
def quality() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # a 4 M-param model: one thread is fastest, and steady on a busy machine
    try:
        return weight_quality("pydoc", ("int8", "int4"), num_passages=NUM_PASSAGES, greedy=False)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_weights_keep_held_out_bits_per_byte(quality, scheme):
    row = quality[scheme]
    assert row["plan"] is not None and quality["none"]["plan"] is None
    assert abs(row["bpb_rel_diff"]) <= WEIGHT_TARGETS[scheme], row
    assert row["bpb_rel_diff_max_passage"] <= 2 * WEIGHT_TARGETS[scheme], row
