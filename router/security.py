"""Bearer-token authentication, TLS credentials and the loopback-bind rule.

- A configured token is required on every RPC except the standard health
  check (load balancers and probes call it without credentials):
  metadata ``authorization: Bearer <token>``, compared in constant time.
- Binding to a non-loopback address without a token is refused at start.
- TLS: server certificate chain + key; with ``client_ca_path`` the server
  also demands a client certificate signed by that CA (mTLS).
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from router.log import log_event

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
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


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Reject RPCs whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self.num_rejected = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        provided = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                provided = value.encode() if isinstance(value, str) else value
                break
        if hmac.compare_digest(provided, self._expected):
            return handler
        self.num_rejected += 1
        reason = "missing" if not provided else "invalid"
        log_event("auth_rejected", logging.WARNING, method=method, reason=reason)
        return _deny_handler(handler, f"{reason} bearer token: send metadata 'authorization: Bearer <token>'")


def _deny_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts UNAUTHENTICATED."""

    async def deny(request_or_iterator: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
