"""The security section: token from the environment, TLS files (deploy/config/security.py)."""
from __future__ import annotations

from deploy.config import load_config


def test_security_token_from_env_and_tls(monkeypatch, pem_files, write_yaml):
    monkeypatch.setenv("MY_TOKEN", "abc")
    path = write_yaml("server: {host: 0.0.0.0}\nsecurity: {token_env: MY_TOKEN, "
                      "tls_cert: cert.pem, tls_key: key.pem, tls_client_ca: ca.pem}\n")
    config = load_config(path)
    assert config.security.token.get_secret_value() == "abc"
    assert config.security.tls_client_ca == pem_files["ca.pem"]
    for host in ("localhost", "127.0.0.2", "::1"):
        assert load_config(None, {"server.host": host}).security.token is None
