"""A Ray cluster with a token, internal mutual TLS and /metrics serves through the TLS paths, while its
KV and token-stream ports refuse plaintext and the public token, and /metrics wants the bearer token."""
from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import msgpack
import pytest

from kv_transfer import TOKEN_KEY
from proto.internal_auth import internal_secret
from kv_transfer.transports.grpc import SERVICE
from router.client import generate

from cluster_support import ClusterThread
from tls_support import make_certs

TOKEN = "cluster-public-token"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    import ray

    from deploy.config import load_config
    from deploy.launcher import init_ray
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    init_ray(num_cpus=8)
    cfg = load_config(None, {
        "model.name": tiny_model_dir, "model.dtype": "float32", "kv_cache.num_blocks": 256,
        "pools.prefill.resources.num_cpus": 0.5, "pools.decode.resources.num_cpus": 0.5,
        "pools.prefill.resources.torch_threads": 1, "pools.decode.resources.torch_threads": 1,
        "kv_transfer.transport": "grpc", "kv_transfer.compression": "none", "server.metrics_port": 0,
        "security.token": TOKEN, "security.internal_tls_cert": str(certs / "node.pem"),
        "security.internal_tls_key": str(certs / "node.key"), "security.internal_tls_ca": str(certs / "ca.pem"),
    })
    running = ClusterThread(cfg)
    yield running, certs
    running.stop()
    ray.shutdown()


def _handshake_code(channel: grpc.Channel, token: str) -> grpc.StatusCode:
    with channel:
        try:
            channel.unary_unary(f"/{SERVICE}/Handshake")(msgpack.packb({}), metadata=((TOKEN_KEY, token),), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_serves_over_internal_tls_and_refuses_plaintext_and_the_public_token(cluster):
    running, certs = cluster
    replies = list(generate(running.address, token_ids=list(range(2, 40)), max_tokens=4, ignore_eos=True,
                            temperature=0.0, token=TOKEN, timeout=60))
    assert replies[-1].usage.completion_tokens == 4           # KV over grpc + TLS, tokens over the TLS stream
    decode = running.cluster.backend.pools.decode[0]
    kv_endpoint, stream_endpoint = decode.endpoint, decode.client.stream_endpoint
    assert kv_endpoint.startswith("127.0.0.1:") and stream_endpoint.startswith("127.0.0.1:")
    for endpoint in (kv_endpoint, stream_endpoint):
        assert _handshake_code(grpc.insecure_channel(endpoint), internal_secret(TOKEN)) == grpc.StatusCode.UNAVAILABLE
    tls = running.cluster.factory.tls
    options = tls.channel_options()
    # over mutual TLS: the public token is refused, the derived secret gets as far as the layout check
    kv = grpc.secure_channel(kv_endpoint, tls.channel_credentials(), options)
    assert _handshake_code(kv, TOKEN) == grpc.StatusCode.UNAUTHENTICATED
    kv = grpc.secure_channel(kv_endpoint, tls.channel_credentials(), options)
    assert _handshake_code(kv, internal_secret(TOKEN)) == grpc.StatusCode.FAILED_PRECONDITION

    url = running.cluster.metrics_url
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=5)
    assert refused.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=5) as reply:
        assert 'pdserve_requests_total{finish_reason="length"} 1.0' in reply.read().decode()
