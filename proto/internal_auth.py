"""Who may call a pdserve server: one token check, interceptors that run it before a body is read,
the internal secret, and the mutual TLS of the internal endpoints (KV service, decode token stream).

It is part of the contract between pdserve processes, like the messages beside it: the router, the
KV transports, the decode stream and the launcher all import it from here, and it needs neither
torch nor ray.

    secret = internal_secret(cluster_token)            # what internal peers present, never the token itself
    gate = TokenGate(TOKEN_KEY, secret, message="receiver rejected the cluster token")
    server = grpc.server(pool, interceptors=[TokenInterceptor(gate)], maximum_concurrent_rpcs=64)
    bound = add_port(server, "127.0.0.1:0", tls)      # tls: InternalTLS | None
    channel = open_channel(endpoint, tls)              # sync; asynchronous=True for grpc.aio

- `token_matches` is the one comparison (constant time) behind every token check: the KV
  service, the decode token stream and the router's public bearer token.
- An interceptor sees only the call's method and metadata. A refused call gets a handler that
  reads no message and aborts UNAUTHENTICATED, so an unauthenticated peer never makes the
  server receive (or allocate) a body, however large the message it announces.
- `internal_secret(token)` = hex HMAC-SHA256(token, "pdserve-internal-v1"). Internal endpoints
  accept only it and the router's public port only the token, so the public token never travels
  between nodes and never reaches an actor, and what crosses the internal network (or sits in
  an actor) does not open the public API. Whoever holds the token can derive the secret: it
  separates the two uses of one credential, it does not add a second one.
- `InternalTLS`: one certificate and key per node, presented as server certificate (KV service,
  decode stream) and as client certificate (KV senders, the router's stream client); both ends
  require the other's certificate to chain to the configured CA (mutual TLS).
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

INTERNAL_SECRET_LABEL = b"pdserve-internal-v1"


def token_matches(presented: str | bytes | None, expected: str | bytes) -> bool:
    """Constant-time equality of a presented credential and the expected one (None = absent)."""
    if presented is None:
        presented = b""
    a = presented.encode() if isinstance(presented, str) else bytes(presented)
    b = expected.encode() if isinstance(expected, str) else bytes(expected)
    return hmac.compare_digest(a, b)


def internal_secret(token: str) -> str:
    """The secret internal endpoints accept, derived from the cluster token (hex HMAC-SHA256)."""
    if not token:
        raise ValueError("the cluster token must not be empty")
    return hmac.new(token.encode(), INTERNAL_SECRET_LABEL, hashlib.sha256).hexdigest()


class TokenGate:
    """The rule of one server: metadata ``key`` must equal ``expected``, except on ``exempt`` methods.

    Args:
        key: metadata key (lower case), e.g. ``x-pdserve-token`` or ``authorization``.
        expected: the whole value a caller must send, e.g. the internal secret or ``Bearer <token>``.
        exempt: method-name prefixes let through without a token (the health check).
        message: the UNAUTHENTICATED details; ``{reason}`` becomes "missing" or "invalid".
        on_reject: called with (method, reason) for every refused call (counters, logs).
        canonical: maps a presented value to the form ``expected`` is written in before the
            comparison (the bearer scheme's spelling, `router.security.bearer_canonical`).
    """

    def __init__(self, key: str, expected: str, *, exempt: Sequence[str] = (), message: str = "{reason} token",
                 on_reject: Callable[[str, str], None] | None = None,
                 canonical: Callable[[str], str] | None = None) -> None:
        self.key, self.expected, self.exempt = key, expected, tuple(exempt)
        self.message, self.on_reject, self.canonical = message, on_reject, canonical
        self.num_rejected = 0

    def refusal(self, details: grpc.HandlerCallDetails) -> str | None:
        """None when the call may proceed, else the UNAUTHENTICATED details for it."""
        method = details.method or ""
        if self.exempt and method.startswith(self.exempt):
            return None
        presented = None
        for key, value in details.invocation_metadata or ():
            if key == self.key:
                presented = value
                break
        if presented and self.canonical is not None:
            presented = self.canonical(presented)
        if token_matches(presented, self.expected):
            return None
        reason = "missing" if not presented else "invalid"
        self.num_rejected += 1
        if self.on_reject is not None:
            self.on_reject(method, reason)
        return self.message.format(reason=reason)


class TokenInterceptor(grpc.ServerInterceptor):
    """`TokenGate` for a sync ``grpc.server``."""

    def __init__(self, gate: TokenGate) -> None:
        self.gate = gate

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        refusal = self.gate.refusal(handler_call_details)
        return handler if refusal is None else deny_handler(handler, refusal, asynchronous=False)


class AsyncTokenInterceptor(grpc.aio.ServerInterceptor):
    """`TokenGate` for a ``grpc.aio`` server."""

    def __init__(self, gate: TokenGate) -> None:
        self.gate = gate

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        refusal = self.gate.refusal(handler_call_details)
        return handler if refusal is None else deny_handler(handler, refusal, asynchronous=True)


def deny_handler(handler: grpc.RpcMethodHandler, message: str, *, asynchronous: bool) -> grpc.RpcMethodHandler:
    """A handler that aborts UNAUTHENTICATED without reading a message.

    It is request-streaming whatever ``handler`` is (the server then leaves the body unread);
    the response side keeps ``handler``'s shape.
    """
    if asynchronous:
        async def deny(requests: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    else:
        def deny(requests: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    serializer = handler.response_serializer
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, response_serializer=serializer)
    return grpc.stream_unary_rpc_method_handler(deny, response_serializer=serializer)


@dataclass(frozen=True)
class InternalTLS:
    """PEM files of a node's internal mutual TLS (the ``security.internal_tls_*`` keys).

    Attributes:
        cert_path: this node's certificate chain, presented as server and as client certificate.
        key_path: its private key.
        ca_path: the CA bundle every internal peer's certificate must chain to.
        server_name: the name clients check in a server's certificate; "" = the address dialled
            (then each node's certificate needs its IP address as a subjectAltName).
    """

    cert_path: str
    key_path: str
    ca_path: str
    server_name: str = ""

    def _pem(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.key_path).read_bytes(), Path(self.cert_path).read_bytes(), Path(self.ca_path).read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: present the node certificate, require a client certificate signed by the CA."""
        key, cert, ca = self._pem()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: trust only the CA, present the node certificate."""
        key, cert, ca = self._pem()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def add_port(server, address: str, tls: InternalTLS | None) -> int:
    """Bind ``address`` (mutual TLS when ``tls`` is set); the bound port, 0 on failure."""
    return server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)


def open_channel(target: str, tls: InternalTLS | None, options: Sequence[tuple] = (), *, asynchronous: bool = False):
    """A sync (or ``grpc.aio``) channel to ``target``: mutual TLS when ``tls`` is set, else plaintext."""
    grpc_module = grpc.aio if asynchronous else grpc
    if tls is None:
        return grpc_module.insecure_channel(target, options=list(options))
    return grpc_module.secure_channel(target, tls.channel_credentials(), options=[*options, *tls.channel_options()])
