"""Every metric the issue names is exported over HTTP after one request through an embedded cluster."""
from __future__ import annotations

import socket
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        "kv_transfer.compression": "fp8", "server.metrics_port": free_port(),
    })
    running = ClusterThread(cfg)
    yield running
    running.stop()
    ray.shutdown()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_every_metric_exported_after_one_request(cluster):
    port = cluster.cluster.cfg.server.metrics_port
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
