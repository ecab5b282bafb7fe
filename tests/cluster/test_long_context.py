"""Requests longer than routing.long_request_tokens go to the long-context decode pool."""
from __future__ import annotations

import pytest

from deploy.config import load_config
from engine import SamplingParams
from router.client import generate

from cluster_helpers import ClusterThread, wait_blocks_free


@pytest.fixture(scope="module")
def cluster(ray_local, tiny_model_dir):
    overrides = {
        "model.name": tiny_model_dir, "model.dtype": "float32", "kv_cache.num_blocks": 256,
        "kv_transfer.compression": "none", "routing.long_request_tokens": 300,
    }
    for pool in ("prefill", "decode", "long_context"):
        overrides.update({f"pools.{pool}.count": 1, f"pools.{pool}.resources.num_cpus": 0.5,
                          f"pools.{pool}.resources.torch_threads": 1})
    c = ClusterThread(load_config(None, overrides))
    yield c
    c.stop()


def test_long_requests_use_the_long_context_pool(cluster, reference):
    backend = cluster.cluster.backend
    assert len(backend.pools.long_context) == 1 and len(backend.pools.decode) == 1
    assert backend._decode_pool(301) is backend.pools.long_context and backend._decode_pool(300) is backend.pools.decode
    short, long_ = list(range(2, 50)), list(range(2, 280))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected = reference([short, long_], [params, params])
    seen = []
    original = backend.admission.acquire

    async def spy(views, need, timeout, **kwargs):
        view = await original(views, need, timeout, **kwargs)
        seen.append(view.actor_id)
        return view
    backend.admission.acquire = spy
    try:
        for ids, exp in ((short, expected[0]), (long_, expected[1])):
            got = [t for m in generate(cluster.address, token_ids=ids, max_tokens=30, temperature=0.0,
                                       ignore_eos=True) for t in m.token_ids]
            assert got == exp
    finally:
        backend.admission.acquire = original
    assert seen == [backend.pools.decode[0].actor_id, backend.pools.long_context[0].actor_id]
    assert all(a.kv_blocks_used == 0 for a in wait_blocks_free(cluster.address).actors)
