"""proto/internal_auth.py: the one token check, the derived secret, and the interceptors (sync
and aio) that refuse a call before its handler runs or its body is read."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
from concurrent import futures

import grpc
import pytest

from proto.internal_auth import (
    AsyncTokenInterceptor,
    TokenGate,
    TokenInterceptor,
    internal_secret,
    token_matches,
)

KEY = "x-test-token"


def test_token_matches_is_exact():
    assert token_matches("abc", "abc") and token_matches(b"abc", "abc") and token_matches("", "")
    for presented in (None, "", "ab", "abcd", "ABC", b"abd"):
        assert not token_matches(presented, "abc"), presented


def test_internal_secret_is_hmac_of_the_token_and_never_the_token():
    secret = internal_secret("public-token")
    assert secret == hmac.new(b"public-token", b"pdserve-internal-v1", hashlib.sha256).hexdigest()
    assert secret == internal_secret("public-token") and len(secret) == 64
    assert secret != "public-token" and internal_secret("public-token2") != secret
    with pytest.raises(ValueError, match="must not be empty"):
        internal_secret("")


def _gate(rejected: list) -> TokenGate:
    return TokenGate(KEY, "s3cret", exempt=("/test.Svc/Open",), message="{reason} test token",
                     on_reject=lambda method, reason: rejected.append((method, reason)))


def test_sync_interceptor_refuses_before_the_handler_and_the_body():
    calls, rejected = [], []
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[TokenInterceptor(_gate(rejected))],
                         options=[("grpc.max_receive_message_length", 1024)])
    handlers = {name: grpc.unary_unary_rpc_method_handler(lambda body, context: calls.append(body) or b"ok")
                for name in ("Echo", "Open")}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Svc", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]) as channel:
            def code(method: str, body: bytes, token: str | None) -> grpc.StatusCode:
                metadata = ((KEY, token),) if token is not None else None
                try:
                    channel.unary_unary(f"/test.Svc/{method}")(body, metadata=metadata, timeout=10)
                except grpc.RpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            assert code("Echo", b"x", "s3cret") == grpc.StatusCode.OK
            assert code("Echo", b"x", "wrong") == grpc.StatusCode.UNAUTHENTICATED
            assert code("Echo", b"x", None) == grpc.StatusCode.UNAUTHENTICATED
            assert code("Echo", bytes(4096), "wrong") == grpc.StatusCode.UNAUTHENTICATED    # over the limit: unread
            assert code("Echo", bytes(4096), "s3cret") == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert code("Open", b"y", None) == grpc.StatusCode.OK                           # exempt
            assert code("Nope", b"z", "wrong") == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(0)
    assert calls == [b"x", b"y"]
    assert rejected == [("/test.Svc/Echo", "invalid"), ("/test.Svc/Echo", "missing"), ("/test.Svc/Echo", "invalid")]


def test_aio_interceptor_refuses_streaming_calls_with_the_message():
    calls, rejected = [], []
    gate = _gate(rejected)

    async def stream(body: bytes, context):
        calls.append(body)
        yield b"token"

    async def main():
        server = grpc.aio.server(interceptors=[AsyncTokenInterceptor(gate)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "test.Svc", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_stream("/test.Svc/Stream")
                assert [r async for r in call(b"a", metadata=((KEY, "s3cret"),), timeout=10)] == [b"token"]
                with pytest.raises(grpc.RpcError) as refused:
                    [r async for r in call(b"b", metadata=((KEY, "s3cre"),), timeout=10)]
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert refused.value.details() == "invalid test token"
        finally:
            await server.stop(0)

    asyncio.run(main())
    assert calls == [b"a"] and rejected == [("/test.Svc/Stream", "invalid")] and gate.num_rejected == 1
