"""/metrics access (router/metrics.py): with a token every scrape needs ``Authorization: Bearer``;
without one the server binds loopback only."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from router.metrics import Metrics

TOKEN = "metrics-s3cret"


def _get(port: int, path: str = "/metrics", authorization: str | None = None) -> tuple[int, str, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, reply.read().decode(), dict(reply.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


@pytest.fixture
def metrics():
    metrics = Metrics()
    metrics.request_finished("stop", ttft_s=0.1, e2e_s=0.2, queue_s=0.0, num_output_tokens=2)
    yield metrics
    metrics.stop()


def test_with_a_token_every_scrape_needs_the_bearer_token(metrics):
    port = metrics.serve("127.0.0.1", 0, token=TOKEN)
    for authorization in (None, "", TOKEN, f"Bearer {TOKEN}x", f"Basic {TOKEN}", "Bearer "):
        status, body, headers = _get(port, authorization=authorization)
        assert status == 401 and "pdserve" not in body, authorization
        assert headers["WWW-Authenticate"].startswith("Bearer")
    for authorization in (f"Bearer {TOKEN}", f"bearer {TOKEN}"):      # the scheme is case-insensitive
        status, body, _ = _get(port, authorization=authorization)
        assert status == 200 and 'pdserve_requests_total{finish_reason="stop"} 1.0' in body
    assert _get(port, "/elsewhere", f"Bearer {TOKEN}")[0] == 404


def test_without_a_token_it_serves_loopback_only(metrics):
    port = metrics.serve("127.0.0.1", 0, token=None)
    status, body, _ = _get(port)
    assert status == 200 and "pdserve_ttft_seconds_count 1.0" in body
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(ValueError, match=r"^server\.metrics_port: refusing to serve /metrics on non-loopback"):
            Metrics().serve(host, 0, token=None)          # refused before it binds
