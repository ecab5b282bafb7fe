"""Every metric in METRICS is exported over HTTP after one request through an embedded cluster."""
from __future__ import annotations

import time
import urllib.request

import pytest

from router.client import generate

from cluster_support import ClusterThread

METRICS = (
    "pdserve_ttft_seconds", "pdserve_tpot_seconds", "pdserve_itl_seconds", "pdserve_e2e_seconds",
    "pdserve_queue_seconds", "pdserve_kv_transfer_seconds", "pdserve_kv_transfer_bytes_total",
    "pdserve_kv_wire_bytes_total", "pdserve_prefix_cache_hit_tokens_total", "pdserve_kv_blocks_used",
    "pdserve_requests_total", "pdserve_transfer_failures_total", "pdserve_local_prefills_total",
)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    import ray

    from deploy.config import load_config
    from deploy.launcher import init_ray
    init_ray(num_cpus=8)
    cfg = load_config(None, {
        "model.name": tiny_model_dir, "model.dtype": "float32", "kv_cache.num_blocks": 256,
        "pools.prefill.resources.num_cpus": 0.5, "pools.decode.resources.num_cpus": 0.5,
        "pools.prefill.resources.torch_threads": 1, "pools.decode.resources.torch_threads": 1,
        "kv_transfer.compression": "fp8", "server.metrics_port": 0,
    })
    running = ClusterThread(cfg)
    yield running
    running.stop()
    ray.shutdown()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_every_metric_exported_after_one_request(cluster):
    port = cluster.cluster.metrics_port
    msgs = list(generate(cluster.address, token_ids=list(range(2, 70)), max_tokens=6, ignore_eos=True,
                         temperature=0.0, timeout=60))
    assert msgs[-1].usage.completion_tokens == 6
    end = time.monotonic() + 10
    while True:                                  # block gauges come from a 1 s poll
        text = scrape(port)
        if 'pdserve_kv_blocks_used{actor="decode-0",role="decode"}' in text or time.monotonic() > end:
            break
        time.sleep(0.2)
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in METRICS:
        assert any(n == name or n.startswith(name + "_") for n in names), name
    assert 'pdserve_requests_total{finish_reason="length"} 1.0' in text
    assert 'pdserve_kv_transfer_bytes_total{codec="fp8"}' in text
    assert 'pdserve_kv_blocks_used{actor="prefill-0",role="prefill"}' in text


def test_internal_connections_a_decode_actor_refused_are_counted(cluster):
    """A KV handshake with a wrong secret, then a token-stream call with one: both in one counter."""
    import grpc
    import torch

    from kv_transfer import KVLayout
    from tls_support import handshake_code
    port = cluster.cluster.metrics_port
    view = cluster.cluster.backend.pools.decode[0]
    layout = KVLayout(num_layers=1, num_kv_heads=1, block_size=4, head_dim=8, dtype=torch.float32,
                      model_fingerprint="x")
    assert handshake_code(grpc.insecure_channel(view.endpoint), layout, "forged", "fp8") == \
        grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(view.client.stream_endpoint) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            decode = channel.unary_stream("/pdserve.v1.DecodeStreamService/Decode")
            list(decode(b"", metadata=(("x-pdserve-token", "forged"),), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    line = 'pdserve_internal_refused_connections_total{actor="decode-0",reason="bad_token",role="decode"} 2.0'
    end = time.monotonic() + 10
    while line not in (text := scrape(port)):   # the counter follows a 1 s poll of the actors
        assert time.monotonic() < end, [x for x in text.splitlines() if "refused_connections" in x]
        time.sleep(0.2)
