"""Per-pool weight quantization through the whole cluster: an unquantized prefill pool hands its exact
KV to an int4 decode pool (the handshake admits them: quantization changes neither the weights'
fingerprint nor the KV layout). Each actor reports how its weights are stored, and every stream
equals the one the same pair of engines gives in process (prefill unquantized, decode int4)."""
from __future__ import annotations

import ray

from cluster_helpers import cluster_config, prompts_and_params, wait_blocks_free
from cluster_support import ClusterThread
from engine import SamplingParams
from router.client import generate
from worker_support import Collector, decode_job, prefill_job, wait_blocks_returned, wait_for, worker_pair

N = 4
MAX_TOKENS = 12


def _in_process(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    """The same requests one at a time through an unquantized prefill worker and an int4 decode worker."""
    prefill, decode, _ = worker_pair(model_dir, quantization="int4")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        assert prefill.engine.quantization == "none" and decode.engine.quantization == "int4"
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
    expected = _in_process(tiny_model_dir, prompts)
    cfg = cluster_config(tiny_model_dir, "grpc", "none", 1, 1, local_prefill_tokens=0,
                         extra={"pools.decode.quantization": "int4"})
    c = ClusterThread(cfg)
    try:
        views = [*c.cluster.backend.pools.prefill, *c.cluster.backend.pools.decode]
        infos = [ray.get(v.client.handle.info.remote(), timeout=30) for v in views]
        assert [(i["role"], i["quantization"]) for i in infos] == [("prefill", "none"), ("decode", "int4")]
        got = []
        for prompt in prompts:
            tokens = []
            for msg in generate(c.address, token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                ignore_eos=True, timeout=60):
                tokens += msg.token_ids
            got.append(tokens)
        assert got == expected
        stats = wait_blocks_free(c.address, timeout=30)
        assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    finally:
        c.stop()
