"""Bearer-token authentication, TLS credentials and the loopback-bind rule.

- A configured token is required on every RPC except the standard health
  check, ``Health/Check`` (load balancers and probes call it without credentials;
  ``Health/Watch`` holds a stream open, so it takes the token like the rest), and on every
  HTTP request except ``GET /health`` (`check_http_bearer`):
  metadata ``authorization: Bearer <token>``, compared in constant time by the
  check every pdserve server shares (`proto.internal_auth`), before the
  request body is read. Internal endpoints take a secret derived from the
  token instead (`internal_secret`), never the token itself.
- Binding to a non-loopback address without a token is refused at start.
- TLS: server certificate chain + key; with ``client_ca_path`` the server
  also demands a client certificate signed by that CA (mTLS).
"""
from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from proto.internal_auth import AsyncTokenInterceptor, TokenGate, token_matches
from router.log import log_event

HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"  # the one RPC open without a token
_LOOPBACK_NAMES = ("localhost", "ip6-localhost")


@dataclass(slots=True)
class TLSConfig:
    """PEM files for the server side of TLS.

    Attributes:
        cert_path: server certificate chain (PEM).
        key_path: server private key (PEM).
        client_ca_path: CA bundle (PEM) that client certificates must chain
            to; when set, clients without a valid certificate are refused (mTLS).
    """

    cert_path: str | Path
    key_path: str | Path
    client_ca_path: str | Path | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Read the PEM files and build gRPC server credentials."""
        key = Path(self.key_path).read_bytes()
        cert = Path(self.cert_path).read_bytes()
        client_ca = Path(self.client_ca_path).read_bytes() if self.client_ca_path else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )


def is_loopback(host: str) -> bool:
    """True for ``127.0.0.0/8``, ``::1`` and the usual localhost names."""
    host = host.strip("[]")
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback bind without a token.

    Raises:
        ValueError: naming the host.
    """
    if not token and not is_loopback(host):
        raise ValueError(
            f"refusing to serve on non-loopback host {host!r} without an auth token; "
            "set a token or bind to 127.0.0.1"
        )


class BearerTokenInterceptor(AsyncTokenInterceptor):
    """Reject RPCs whose ``authorization`` metadata is not ``Bearer <token>`` (UNAUTHENTICATED, body unread)."""

    def __init__(self, token: str, on_reject: Callable[[str], None] | None = None) -> None:
        if not token:
            raise ValueError("auth token must not be empty")

        def rejected(method: str, reason: str) -> None:
            _log_rejected(method, reason)
            if on_reject is not None:
                on_reject(reason)
        super().__init__(TokenGate("authorization", f"Bearer {token}", exempt=(HEALTH_CHECK_METHOD,),
                                   message="{reason} bearer token: send metadata 'authorization: Bearer <token>'",
                                   on_reject=rejected, canonical=bearer_canonical))

    @property
    def num_rejected(self) -> int:
        return self.gate.num_rejected


def bearer_canonical(authorization: str) -> str:
    """``Bearer <credentials>`` for an ``Authorization`` value whose scheme is ``Bearer`` in any case,
    with any run of spaces after it (RFC 7235: the scheme is case-insensitive); other values as they are."""
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip(" "):
        return authorization
    return f"Bearer {credentials.lstrip(' ')}"


def check_http_bearer(authorization: str | None, token: str, path: str) -> str | None:
    """The HTTP front door's check of ``Authorization: Bearer <token>`` (constant time).

    Returns:
        None when it matches; else "missing" or "invalid" (logged as ``auth_rejected``).
    """
    if authorization and token_matches(bearer_canonical(authorization), f"Bearer {token}"):
        return None
    reason = "missing" if not authorization else "invalid"
    _log_rejected(path, reason)
    return reason


def _log_rejected(method: str, reason: str) -> None:
    log_event("auth_rejected", logging.WARNING, method=method, reason=reason)
