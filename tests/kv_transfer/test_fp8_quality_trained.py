"""Gate: FP8 KV (per-block scales) on the trained model, shipped through a real sender → wire →
receiver into a decode engine's cache, keeps the held-out continuation's perplexity within 1%
of codec `none`, and greedy paths fork only where codec `none` itself was at a near tie.

A smaller version of `python -m bench.trained_quality` (full figures: docs/benchmarks/transfer.md,
"FP8 KV quality on the trained model"):
8 passages over the fake transport (the real wire format without a socket) and the eager codec
(the compiled kernels make the same bytes: test_codec_compiled.py).
"""
from __future__ import annotations

import math

import pytest
import torch

from bench.trained_quality import kv_codec_quality
from engine.model.presets import TRAINED
from bench.train.passages import load_passages

NUM_PASSAGES = 8
MAX_MARGIN_AT_FORK = 0.1     # nats; the 64-passage bench's largest is 0.032 (docs/benchmarks/transfer.md)


@pytest.fixture(scope="module")
def quality() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # a 4 M-param model: one thread is fastest, and steady on a busy machine
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PDSERVE_KV_COMPILE", "0")
            return kv_codec_quality("pydoc", num_passages=NUM_PASSAGES, codecs=("fp8",), attention="eager",
                                    transport="fake", bf16_reference=False)
    finally:
        torch.set_num_threads(threads)


def test_fp8_kv_keeps_continuation_perplexity_within_one_percent(quality):
    assert quality["fp8"]["ppl_rel_diff"] <= 0.01, quality
    assert quality["fp8"]["ppl_rel_diff_max_passage"] <= 0.02, quality


def test_fp8_kv_forks_greedy_paths_only_at_near_ties(quality):
    """A codec that loses information flips tokens the model was sure of; fp8's rounding only
    tips near ties (a 4 M-param model has many: see the identical-sequence rate in the docs)."""
    assert quality["fp8"]["max_margin_at_fork"] < MAX_MARGIN_AT_FORK, quality
    assert quality["fp8"]["greedy_prefix_agreement"] > 0.25, quality


def test_fp8_kv_travels_in_a_quarter_of_the_bytes(quality):
    # float32 cache: 1 byte per element + one float32 scale per (layer, block, K/V, head) of 16 x 64 elements
    ratio = quality["fp8"]["wire_bytes"] / quality["none"]["wire_bytes"]
    assert ratio == pytest.approx(1 / 4 + 1 / (16 * 64), rel=1e-6), quality


def test_codec_none_scores_exactly_what_hf_scores(quality):
    """The teacher-forced measure on received KV equals a plain full-sequence forward in HF."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(TRAINED["pydoc"], dtype=torch.float32)
    prompt = quality["prompt_tokens"]
    nll, count = 0.0, 0
    with torch.no_grad():
        for passage in load_passages(TRAINED["pydoc"])[:NUM_PASSAGES]:
            x = torch.tensor([passage])
            logits = hf(input_ids=x[:, :-1]).logits[0, prompt:]
            nll += torch.nn.functional.cross_entropy(logits, x[0, prompt + 1:], reduction="sum").item()
            count += len(passage) - prompt - 1
    assert math.exp(nll / count) == pytest.approx(quality["none"]["ppl"], rel=1e-4)
