"""`bench.serving` end to end on the tiny model: a handful of requests, JSON with the required keys.

No timing assertions: the machine is shared.
"""
from __future__ import annotations

import json

import pytest

REQUIRED = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "itl_p99_s", "goodput_rps",
            "throughput_tokens_s", "completed", "failed")


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from deploy.launcher import init_ray
    init_ray(num_cpus=8)
    yield
    ray.shutdown()


def small_cluster_flags(model_dir: str) -> list[str]:
    flags = ["--embedded", "--model", model_dir, "--dtype", "float32", "--no-progress"]
    for item in ("kv_cache.num_blocks=256", "pools.prefill.resources.num_cpus=0.5",
                 "pools.decode.resources.num_cpus=0.5", "pools.prefill.resources.torch_threads=1",
                 "pools.decode.resources.torch_threads=1", "pools.prefill.chunk_tokens=32"):
        flags += ["--set", item]
    return flags


def test_compare_cold_and_warm_writes_every_run(tiny_model_dir, ray_session, tmp_path, capsys):
    from bench.serving import main
    out = tmp_path / "compare.json"
    rc = main([*small_cluster_flags(tiny_model_dir), "--compare", "colocated,disaggregated",
               "--workload", "shared-prefix", "--scale", "0.05", "--num-requests", "4", "--num-warmup", "1",
               "--request-rate", "20", "--cache", "cold,warm", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    variants = ("colocated", "colocated-chunked", "disaggregated")
    assert set(result["runs"]) == {*variants, *(f"{v}-warm" for v in variants)}
    for name, run in result["runs"].items():
        for key in REQUIRED:
            assert run[key] is not None, (name, key)
        assert (run["completed"], run["failed"]) == (4, 0)
        assert len(run["records"]) == 4 and all(r["ok"] for r in run["records"])
    runs = result["runs"]
    assert runs["disaggregated"]["kv_bytes"] > 0            # scraped from the router's /metrics
    assert runs["colocated"]["kv_bytes"] == 0
    for v in variants:      # the first cold request misses the shared prefix; warm ones should not
        assert runs[f"{v}-warm"]["prefix_hit_rate"] >= runs[v]["prefix_hit_rate"] > 0
    assert any(runs[f"{v}-warm"]["prefix_hit_rate"] > runs[v]["prefix_hit_rate"] for v in variants)
    assert result["lengths"]["input_len"]["max"] >= result["lengths"]["input_len"]["min"]
    text = capsys.readouterr().out
    assert "disaggregated / colocated" in text and "goodput" in text


def test_both_front_doors_against_one_cluster(tiny_model_dir, ray_session, tmp_path):
    """`--api grpc,openai`: the same workload through gRPC and the OpenAI HTTP API of one cluster; every
    request completes with the requested tokens on both (the HTTP overhead is read off the two runs)."""
    from bench.serving import main
    out = tmp_path / "apis.json"
    rc = main([*small_cluster_flags(tiny_model_dir), "--api", "grpc,openai", "--workload", "chat", "--scale", "0.05",
               "--num-requests", "4", "--num-warmup", "1", "--request-rate", "20", "--json", str(out)])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"disaggregated", "disaggregated-openai"}
    assert runs["disaggregated-openai"]["api"] == "openai" and runs["disaggregated"]["api"] == "grpc"
    for name, run in runs.items():
        assert (run["completed"], run["failed"]) == (4, 0), name
        for key in REQUIRED:
            assert run[key] is not None, (name, key)
        for record in run["records"]:
            assert record["num_output_tokens"] == record["output_len"] and record["ttft_s"] > 0, (name, record)
