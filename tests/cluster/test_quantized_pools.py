"""Quantization through the whole cluster. Per-pool weights: an unquantized prefill pool hands its exact
KV to an int4 decode pool (the handshake admits them: quantization changes neither the weights'
fingerprint nor the KV layout). An fp8 KV cache: blocks travel as stored. Each actor reports how it
stores weights and KV, and every stream equals the one the same pair of engines gives in process."""
from __future__ import annotations

import ray

from cluster_helpers import cluster_config, prompts_and_params, wait_blocks_free
from cluster_support import ClusterThread
from engine import SamplingParams
from router.client import generate
from worker_support import Collector, decode_job, prefill_job, wait_blocks_returned, wait_for, worker_pair

N = 4
MAX_TOKENS = 12


def _in_process(model_dir: str, prompts: list[list[int]], **pair) -> list[list[int]]:
    """The same requests one at a time through a prefill and a decode worker (`pair`: worker_pair's options)."""
    prefill, decode, _ = worker_pair(model_dir, **pair)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        out = []
        for i, prompt in enumerate(prompts):
            c, results, rid = Collector(), [], f"r{i}"
            job = prefill_job(rid, prompt, params, decode.endpoint)
            decode.submit(decode_job(rid, prompt, params, transfer_id=job.transfer_id), c.sink(rid))
            prefill.submit(job, results.append)
            assert c.done.wait(30) and wait_for(lambda: results, 10)
            out.append(c.tokens(rid))
        wait_blocks_returned(prefill.engine, decode.engine)
        return out
    finally:
        prefill.stop()
        decode.stop()


def test_int4_decode_pool_serves_kv_from_an_unquantized_prefill_pool(ray_local, tiny_model_dir):
    prompts, _ = prompts_and_params(N, seed=11, max_len=120)
    expected = _in_process(tiny_model_dir, prompts, quantization="int4")     # (the decode side's engine)
    cfg = cluster_config(tiny_model_dir, "grpc", "none", 1, 1, local_prefill_tokens=0,
                         extra={"pools.decode.quantization": "int4"})
    c = ClusterThread(cfg)
    try:
        views = [*c.cluster.backend.pools.prefill, *c.cluster.backend.pools.decode]
        infos = [ray.get(v.client.handle.info.remote(), timeout=30) for v in views]
        assert [(i["role"], i["quantization"]) for i in infos] == [("prefill", "none"), ("decode", "int4")]
        assert _one_at_a_time(c.address, prompts) == expected
        stats = wait_blocks_free(c.address, timeout=30)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    finally:
        c.stop()


def _one_at_a_time(address: str, prompts: list[list[int]]) -> list[list[int]]:
    got = []
    for prompt in prompts:
        tokens = []
        for msg in generate(address, token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                            ignore_eos=True, timeout=60):
            tokens += msg.token_ids
        got.append(tokens)
    return got


def test_an_fp8_kv_cache_ships_its_blocks_as_stored_through_the_cluster(ray_local, tiny_model_dir):
    """kv_cache.dtype fp8 on every pool: the layer-wise tcp handoff carries the cells as stored (codec
    fp8_cache, implied), and each stream equals the in-process pair with the same cache."""
    prompts, _ = prompts_and_params(N, seed=12, max_len=120)
    expected = _in_process(tiny_model_dir, prompts, transport="tcp", kv_cache_dtype="fp8")
    cfg = cluster_config(tiny_model_dir, "tcp", "none", 1, 1, local_prefill_tokens=0,
                         extra={"kv_cache.dtype": "fp8"})
    assert cfg.transfer_codec() == "fp8_cache"
    c = ClusterThread(cfg)
    try:
        views = [*c.cluster.backend.pools.prefill, *c.cluster.backend.pools.decode]
        infos = [ray.get(v.client.handle.info.remote(), timeout=30) for v in views]
        assert [i["kv_cache_dtype"] for i in infos] == ["fp8", "fp8"]
        assert _one_at_a_time(c.address, prompts) == expected
        stats = wait_blocks_free(c.address, timeout=30)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    finally:
        c.stop()
