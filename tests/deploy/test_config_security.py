"""The security section: token from the environment, TLS files, internal TLS files (deploy/config/security.py)."""
from __future__ import annotations

import re

import pytest

from deploy.config import ConfigError, load_config


def test_security_token_from_env_and_tls(monkeypatch, pem_files, write_yaml):
    monkeypatch.setenv("MY_TOKEN", "abc")
    path = write_yaml("server: {host: 0.0.0.0}\nsecurity: {token_env: MY_TOKEN, "
                      "tls_cert: cert.pem, tls_key: key.pem, tls_client_ca: ca.pem}\n")
    config = load_config(path)
    assert config.security.token.get_secret_value() == "abc"
    assert config.security.tls_client_ca == pem_files["ca.pem"]
    for host in ("localhost", "127.0.0.2", "::1"):
        assert load_config(None, {"server.host": host}).security.token is None


def test_internal_tls_files_and_server_name(pem_files, write_yaml):
    path = write_yaml("security: {internal_tls_cert: cert.pem, internal_tls_key: key.pem, internal_tls_ca: ca.pem, "
                      "internal_tls_server_name: pdserve-internal}\n")
    tls = load_config(path).security.internal_tls()
    files = (pem_files["cert.pem"], pem_files["key.pem"], pem_files["ca.pem"])
    assert (tls.cert_path, tls.key_path, tls.ca_path) == files
    assert tls.server_name == "pdserve-internal"
    assert load_config(None).security.internal_tls() is None


@pytest.mark.parametrize("text, key, expected", [
    ("{internal_tls_cert: cert.pem}", "security.internal_tls_key", "required when security.internal_tls_cert is set"),
    ("{internal_tls_cert: cert.pem, internal_tls_key: key.pem}", "security.internal_tls_ca",
     "required when security.internal_tls_cert is set (internal TLS is mutual"),
    ("{internal_tls_ca: ca.pem}", "security.internal_tls_cert", "required when security.internal_tls_ca is set"),
    ("{internal_tls_server_name: pdserve-internal}", "security.internal_tls_cert",
     "required when security.internal_tls_server_name is set"),
    ("{internal_tls_cert: nope.pem, internal_tls_key: key.pem, internal_tls_ca: ca.pem}",
     "security.internal_tls_cert", "file not found: "),
    ("{internal_tls_certificate: cert.pem}", "security.internal_tls_certificate", "unknown key (allowed: token,"),
])
def test_internal_tls_errors_name_the_key(pem_files, write_yaml, text, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(f"security: {text}\n"))
    assert info.value.key == key and str(info.value).startswith(f"{key}: {expected}"), str(info.value)


@pytest.mark.parametrize("token", [" s3cret", "s3cret ", "s3cret\t", "s3c\nret", "pässwort"])
def test_a_token_no_client_could_send_is_refused_without_showing_it(monkeypatch, token):
    # the router compares `Bearer <token>` with the header as received: spaces at its edges are stripped,
    # and a header value is printable ASCII
    message = ("the token must be printable ASCII without leading or trailing spaces (clients send it in an "
               "Authorization header)")
    with pytest.raises(ConfigError, match=rf"^security\.token: {re.escape(message)}$") as info:
        load_config(None, {"security.token": token})
    assert token.strip() not in str(info.value)
    monkeypatch.setenv("MY_TOKEN", token)
    with pytest.raises(ConfigError, match=rf"^security\.token_env: {re.escape(message)}$"):
        load_config(None, {"security.token_env": "MY_TOKEN"})
    sendable = "s3 cr-3t._~+/="
    assert load_config(None, {"security.token": sendable}).security.token.get_secret_value() == sendable
