"""fp8 KV through the codec still drives decoding: small logits error, mostly identical greedy output."""
from __future__ import annotations

from bench.kv_quality import measure


def test_fp8_kv_error_is_small_and_greedy_mostly_agrees(tiny_model_dir):
    result = measure(tiny_model_dir, num_requests=6, max_tokens=16, codecs=("fp8", "fp8_tensor"))
    fp8 = result["fp8"]
    assert 0 < fp8["first_step_logits_rel_l2_mean"] < 0.05     # a broken codec gives O(1)
    assert fp8["greedy_prefix_agreement"] > 0.3
    assert set(result) == {"fp8", "fp8_tensor"}
