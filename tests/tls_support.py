"""Throwaway certificates for TLS tests, made with the openssl CLI (every name is 127.0.0.1/localhost).

    certs = make_certs(tmp_path)        # or the `certs` fixture of a test module
    certs / "ca.pem", "server.pem" + "server.key", "client.pem" + "client.key",
    "node.pem" + "node.key"             # server and client use at once (internal mutual TLS)
    "rogue-ca.pem", "rogue.pem" + "rogue.key"   # a node certificate from another CA
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
_SAN = "subjectAltName=IP:127.0.0.1,DNS:localhost"
_EXTENSIONS = {
    "server": f"{_SAN}\n",
    "client": "extendedKeyUsage=clientAuth\n",
    "node": f"{_SAN}\nextendedKeyUsage=serverAuth,clientAuth\n",
    "rogue": f"{_SAN}\nextendedKeyUsage=serverAuth,clientAuth\n",
}


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(directory: Path) -> Path:
    """Write a CA and certificates it signed (plus a rogue CA and its node) into ``directory``."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    for ca in ("ca", "rogue-ca"):
        _openssl("req", "-x509", *_EC, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "1",
                 "-subj", f"/CN=pdserve-test-{ca}", cwd=directory)
    for name, extensions in _EXTENSIONS.items():
        ca = "rogue-ca" if name == "rogue" else "ca"
        (directory / f"{name}.ext").write_text(extensions)
        _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=directory)
    return directory


def handshake_code(channel, layout, token: str, codec: str):
    """The gRPC status a KV service answers one Handshake of (layout, codec) with over `channel` (closed after)."""
    import grpc
    import msgpack

    from kv_transfer.transports.grpc import SERVICE
    from kv_transfer.wire import TOKEN_KEY
    with channel:
        try:
            channel.unary_unary(f"/{SERVICE}/Handshake")(msgpack.packb(layout.describe(codec)),
                                                         metadata=((TOKEN_KEY, token),), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK
