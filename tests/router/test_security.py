"""Bearer-token auth, the loopback rule, TLS and mTLS (self-signed certs made with openssl)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router import ClientTLS, TLSConfig, build_request, generate, get_stats, start_server
from router.security import check_bind, is_loopback

TOKEN = "s3cret-token"


def _text(address: str, timeout: float = 10, **kwargs) -> str:
    return "".join(r.text for r in generate(address, "abc", max_tokens=3, timeout=timeout, **kwargs))


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def test_token_accepted_and_wrong_or_missing_rejected(serve):
    running = serve(token=TOKEN)
    assert _text(running.address, token=TOKEN) == "cba"
    assert get_stats(running.address, token=TOKEN, timeout=5).totals.num_decode_actors == 1
    for bad in (None, "wrong", TOKEN + "x", TOKEN[:-1]):
        assert _code(lambda: _text(running.address, token=bad)) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: get_stats(running.address, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(running.address) as ch:  # a raw, non-Bearer header
        stub = running.stub(ch)
        call = stub.Generate(build_request("abc"), metadata=(("authorization", TOKEN),), timeout=5)
        assert _code(lambda: list(call)) == grpc.StatusCode.UNAUTHENTICATED
        # the health check stays open to probes without credentials
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert not running.backend.inputs or set(running.backend.inputs) == set(running.backend.finished)


def test_health_watch_takes_the_token_only_check_is_open(serve):
    """Watch holds a stream (and a task) open on the router for as long as the caller likes: open to anyone,
    streams without end would have cost the router memory without bound."""
    running = serve(token=TOKEN)
    with grpc.insecure_channel(running.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=5)
        assert _code(lambda: next(watch)) == grpc.StatusCode.UNAUTHENTICATED
        watch = health.Watch(health_pb2.HealthCheckRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),),
                             timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_bearer_scheme_is_case_insensitive(serve):
    running = serve(token=TOKEN)
    with grpc.insecure_channel(running.address) as ch:
        stub = running.stub(ch)
        for scheme in ("bearer", "BEARER", "Bearer "):
            call = stub.Generate(build_request("abc", max_tokens=3), metadata=(("authorization", f"{scheme} {TOKEN}"),),
                                 timeout=5)
            assert "".join(r.text for r in call) == "cba"
        call = stub.Generate(build_request("abc"), metadata=(("authorization", f"bearer {TOKEN.upper()}"),), timeout=5)
        assert _code(lambda: list(call)) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host):
    assert is_loopback(host)
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.0.2.7", "example.com"])
def test_non_loopback_without_token_refused(loop_thread, make_backend, host):
    assert not is_loopback(host)
    with pytest.raises(ValueError, match=host.replace(".", r"\.")):
        loop_thread.run(start_server(make_backend(), host, 0))
    check_bind(host, TOKEN)  # with a token it may bind (not exercised: tests bind loopback only)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, a server cert for 127.0.0.1/localhost and a client cert, all signed by the CA."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("certs")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=pdserve-test-ca",
             cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return d


def test_tls_with_self_signed_ca(serve, certs):
    running = serve(tls=TLSConfig(certs / "server.pem", certs / "server.key"), token=TOKEN)
    tls = ClientTLS(root_certificates=(certs / "ca.pem").read_bytes())
    assert _text(running.address, tls=tls, token=TOKEN) == "cba"
    assert _code(lambda: _text(running.address, tls=tls)) == grpc.StatusCode.UNAUTHENTICATED
    # plaintext against a TLS port, and TLS that does not trust the CA, both fail
    assert _code(lambda: _text(running.address, token=TOKEN, timeout=2)) == grpc.StatusCode.UNAVAILABLE
    untrusted = ClientTLS(root_certificates=(certs / "client.pem").read_bytes())
    assert _code(lambda: _text(running.address, tls=untrusted, token=TOKEN)) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_client_certificate(serve, certs):
    running = serve(tls=TLSConfig(certs / "server.pem", certs / "server.key", client_ca_path=certs / "ca.pem"))
    ca = (certs / "ca.pem").read_bytes()
    with_cert = ClientTLS(ca, (certs / "client.key").read_bytes(), (certs / "client.pem").read_bytes())
    assert _text(running.address, tls=with_cert) == "cba"
    assert _code(lambda: _text(running.address, tls=ClientTLS(ca))) == grpc.StatusCode.UNAVAILABLE
