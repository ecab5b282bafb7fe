"""The planner's network term: prompt KV bytes ÷ the link's KV bytes/s, and which of prefill, decode or the
link bounds the request rate; its inputs from kv_transfer.link_gbps or a profile's link measurement."""
from __future__ import annotations

import json

import pytest
import torch
from profile_support import COSTS, synthetic

from deploy.planner import SLO, Limits, Network, Workload, link_kv_bytes_per_s, plan
from engine.performance import MeasuredPerformance as Profile

LIMITS = Limits(decode_kv_blocks=100_000, block_size=16, max_batch_size=256)
SLOS = SLO(ttft_s=2.0, tpot_s=0.1)


def test_network_term_is_prompt_kv_over_link_bytes():
    workload = Workload(input_tokens=1000, output_tokens=100, arrival_rate_rps=0.5)
    p = plan(Profile(synthetic()), workload, SLOS, LIMITS, network=Network(40.96e6, "test link"))
    kv_bytes = 1000 * COSTS.kv_bytes_per_token                    # 4.096 MB of prompt KV
    assert p.network["kv_bytes_per_request"] == kv_bytes
    assert p.network["seconds_per_request"] == pytest.approx(0.1)  # 4.096 MB ÷ 40.96 MB/s
    assert p.rate_bounds["link"] == pytest.approx(10.0) == p.network["max_rate_rps"]
    assert p.rate_bounds["prefill"] == pytest.approx(p.n_prefill * p.prefill["tokens_per_s_per_actor"] / 1000)
    assert p.rate_bounds["decode"] == pytest.approx(
        p.n_decode * p.decode["utilization"] * p.decode["tokens_per_s_per_actor"] / 100)
    assert p.network["binding"] == min(p.rate_bounds, key=p.rate_bounds.get) != "link"
    assert any("100.0 ms per handoff" in r and "at most 10.00 req/s" in r for r in p.reasons), p.reasons


def test_a_slow_link_is_reported_as_the_bound():
    workload = Workload(input_tokens=1000, output_tokens=100, arrival_rate_rps=3.0)
    p = plan(Profile(synthetic()), workload, SLOS, LIMITS, network=Network(4.096e6, "slow link"))
    assert p.rate_bounds["link"] == pytest.approx(1.0)
    assert p.network["binding"] == "link" and p.rate_bounds["prefill"] > 1 and p.rate_bounds["decode"] > 1
    assert any(r.startswith("the link, not prefill or decode, bounds the request rate: 1.00 req/s")
               for r in p.reasons), p.reasons
    assert any("workload's 3 req/s exceeds what the link carries (1.00 req/s)" in r for r in p.reasons)
    assert p.to_dict()["network"]["binding"] == "link"


def test_without_a_link_figure_the_term_is_left_out_and_said_so():
    p = plan(Profile(synthetic()), Workload(512, 64, 1.0), SLOS, LIMITS)
    assert p.network == {} and set(p.rate_bounds) == {"prefill", "decode"}
    assert any(r.startswith("network term left out") for r in p.reasons)


def test_link_gbps_and_the_codecs_wire_ratios():
    from kv_transfer import get_codec, wire_bytes_per_kv_byte

    assert link_kv_bytes_per_s(10, 1.0) == pytest.approx(1.25e9)
    assert link_kv_bytes_per_s(1, 0.5) == pytest.approx(0.25e9)
    cell = (1, 1, 2, 4, 16, 64)  # [l, n, 2, H, B, D]
    for dtype in (torch.bfloat16, torch.float32):
        raw = 2 * 4 * 16 * 64 * dtype.itemsize
        for codec, per_value in (("fp8", 1 + 4 / (16 * 64)), ("int8", 1 + 4 / 64)):    # a scale per block / per row
            ratio = wire_bytes_per_kv_byte(codec, dtype.itemsize, 16, 64)
            assert ratio == pytest.approx(get_codec(codec).payload_nbytes(cell, dtype) / raw)
            assert ratio == pytest.approx(per_value / dtype.itemsize)
    assert wire_bytes_per_kv_byte("none", 2, 16, 64) == 1.0


def _plan_json(main, capsys, tiny_model_dir, profile_path, *sets) -> dict:
    args = ["plan", "--model", tiny_model_dir, "--profile", str(profile_path), "--json",
            "--set", "kv_cache.num_blocks=4096", "--set", "workload.input_tokens_mean=1000"]
    for item in sets:
        args += ["--set", item]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_cli_takes_the_link_from_yaml_or_the_matching_measurement(tmp_path, tiny_model_dir, capsys):
    from deploy.cli import main

    profile = synthetic()
    profile["transfer"] = {"transport": "tcp", "codec": "none", "kv_bytes": 1, "wire_bytes": 1, "seconds": 1,
                           "kv_bytes_per_s": 8.192e6, "where": "loopback"}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    out = _plan_json(main, capsys, tiny_model_dir, path, "kv_transfer.transport=tcp", "kv_transfer.compression=none")
    assert out["network"]["source"] == "measured by pdserve profile: tcp, none, loopback"
    assert out["network"]["max_rate_rps"] == pytest.approx(2.0)  # 8.192 MB/s ÷ (1000 × 4096 B)
    out = _plan_json(main, capsys, tiny_model_dir, path, "kv_transfer.transport=grpc", "kv_transfer.compression=none")
    assert out["network"] == {}  # measured with another transport: not this config's link
    out = _plan_json(main, capsys, tiny_model_dir, path, "kv_transfer.compression=none", "kv_transfer.link_gbps=0.1")
    assert out["network"]["kv_bytes_per_s"] == pytest.approx(12.5e6)
    assert out["network"]["source"].startswith("kv_transfer.link_gbps 0.1 Gbit/s")
    assert main(["plan", "--model", tiny_model_dir, "--profile", str(path), "--set", "kv_transfer.link_gbps=0.1",
                 "--set", "workload.input_tokens_mean=1000", "--set", "kv_cache.num_blocks=4096"]) == 0
    table = capsys.readouterr().out
    assert "handoff time per request" in table and "Request rate the plan carries" in table


def test_measure_link_sends_a_prompt_over_the_configured_transport(tiny_model_dir):
    from deploy.config import load_config
    from deploy.link_profiler import measure_link

    cfg = load_config(None, {"model.name": tiny_model_dir, "model.dtype": "float32", "kv_transfer.transport": "tcp",
                             "kv_transfer.compression": "none", "workload.input_tokens_mean": 100,
                             "kv_cache.num_blocks": 64})
    result = measure_link(cfg, tiny_model_dir, reps=2)
    assert "error" not in result, result
    from engine.model.config import ModelConfig

    block_size = cfg.kv_cache.block_size
    blocks = -(-100 // block_size)  # the prompt's blocks, float32 KV of every layer
    assert result["kv_bytes"] == blocks * block_size * ModelConfig.from_dir(tiny_model_dir).kv_bytes_per_token(4)
    assert result["transport"] == "tcp" and result["codec"] == "none" and result["where"] == "loopback"
    assert result["wire_bytes"] > result["kv_bytes"]  # the payload plus the frames
    assert result["kv_bytes_per_s"] == pytest.approx(result["kv_bytes"] / result["seconds"])
