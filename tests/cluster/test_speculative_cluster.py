"""Speculative decoding through the whole cluster (Ray actors, the router's gRPC door): disaggregated
(the decode actor speculates after the KV handoff) and colocated, prompt lookup and a draft model
(the tiny model drafting for itself, prefilled on the decode actor), every greedy stream equals the
engine without speculation, and each request's log line carries its proposed / accepted counts."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cluster_helpers import cluster_config, wait_blocks_free
from cluster_support import ClusterThread
from engine import SamplingParams
from router.client import generate

MAX_TOKENS = 24
SPEC = {"speculative.adaptive": False}


def _looping_prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        span = torch.randint(2, 1000, (6,), generator=g).tolist()
        head = torch.randint(2, 1000, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
        out.append(head + span + head[-2:] + span)
    return out


def _stream(address: str, prompt: list[int]) -> list[int]:
    tokens = []
    for msg in generate(address, token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                        timeout=120):
        tokens += msg.token_ids
    return tokens


@pytest.mark.parametrize("mode, method", [("disaggregated", "ngram"), ("colocated", "ngram"),
                                          ("disaggregated", "draft")])
def test_greedy_streams_equal_the_engine_without_speculation(ray_local, tiny_model_dir, reference, caplog, mode,
                                                            method):
    caplog.set_level(logging.INFO, logger="pdserve.router")
    prompts = _looping_prompts(4)
    expected = reference(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    extra = {**SPEC, "speculative.method": method}
    if method == "draft":
        extra["speculative.draft.model"] = tiny_model_dir
    cfg = cluster_config(tiny_model_dir, "grpc", "none", 1, 1, mode=mode, local_prefill_tokens=0, extra=extra)
    c = ClusterThread(cfg)
    try:
        with ThreadPoolExecutor(4) as pool:                 # in flight together: speculation in a batch
            got = list(pool.map(lambda p: _stream(c.address, p), prompts))
        assert got == expected
        lines = [r.fields for r in caplog.records if getattr(r, "event", None) == "request_finished"]
        assert len(lines) == 4 and sum(f.get("spec_accepted_tokens", 0) for f in lines) > 0
        assert all(f.get("spec_proposed_tokens", 0) >= f.get("spec_accepted_tokens", 0) for f in lines)
        stats = wait_blocks_free(c.address, timeout=30)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    finally:
        c.stop()
