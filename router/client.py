"""Small client helpers for pdserve.v1.GenerationService (used by the CLI and tests).

Sync::

    for response in generate("127.0.0.1:50051", "Hello", max_tokens=8, temperature=0.0):
        print(response.text, end="")

Async::

    async with AsyncGenerationClient("127.0.0.1:50051", token=TOKEN) as client:
        async for response in client.generate("Hello", max_tokens=8):
            ...

Sampling keyword arguments are the `SamplingParams` proto fields
(max_tokens, temperature, top_p, top_k, repetition_penalty,
frequency_penalty, presence_penalty, seed, stop, ignore_eos, min_p, min_tokens,
stop_token_ids, logit_bias, include_stop_str_in_output, skip_special_tokens,
logprobs, prompt_logprobs, n, best_of); None means unset. With n > 1 the
responses of the sequences interleave (``response.index``); the last one
carries usage and timing.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import grpc

from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc


@dataclass(slots=True)
class ClientTLS:
    """Client side of TLS: the CA that signed the server, and an optional client cert (mTLS)."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    request_id: str = "",
    user: str = "",
    **sampling: object,
) -> pb.GenerateRequest:
    """Build a `GenerateRequest` from a prompt or token ids and sampling keywords.

    Raises:
        ValueError: both or neither of prompt/token_ids given, or an unknown sampling field.
    """
    if (prompt is None) == (token_ids is None):
        raise ValueError("give exactly one of prompt or token_ids")
    fields = {k: v for k, v in sampling.items() if v is not None}
    request = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**fields), user=user)
    if prompt is not None:
        request.prompt = prompt
    else:
        request.token_ids.ids.extend(token_ids)
    return request


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``token`` as a bearer token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class AsyncGenerationClient:
    """An asyncio client holding one channel.

    Args:
        address: ``host:port`` of the router.
        token: bearer token, when the server requires one.
        tls: TLS settings; None for a plaintext channel.
    """

    def __init__(self, address: str, *, token: str | None = None, tls: ClientTLS | None = None) -> None:
        self._channel = (
            grpc.aio.secure_channel(address, tls.credentials()) if tls else grpc.aio.insecure_channel(address)
        )
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._metadata = auth_metadata(token)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        request_id: str = "",
        user: str = "",
        timeout: float | None = None,
        **sampling: object,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the responses of one request; leaving the loop early cancels it."""
        request = build_request(prompt, token_ids=token_ids, request_id=request_id, user=user, **sampling)
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def get_stats(self, timeout: float | None = None) -> pb.GetStatsResponse:
        """The cluster's per-actor load and totals."""
        return await self._stub.GetStats(pb.GetStatsRequest(), timeout=timeout, metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def generate(
    address: str,
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    request_id: str = "",
    user: str = "",
    token: str | None = None,
    tls: ClientTLS | None = None,
    timeout: float | None = None,
    **sampling: object,
) -> Iterator[pb.GenerateResponse]:
    """Blocking: stream the responses of one request (opens and closes its own channel).

    Raises:
        grpc.RpcError: the server refused or failed the request (``.code()``, ``.details()``).
    """
    request = build_request(prompt, token_ids=token_ids, request_id=request_id, user=user, **sampling)
    channel = grpc.secure_channel(address, tls.credentials()) if tls else grpc.insecure_channel(address)
    call = pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=timeout, metadata=auth_metadata(token))
    try:
        yield from call
    finally:
        call.cancel()
        channel.close()


def get_stats(
    address: str, *, token: str | None = None, tls: ClientTLS | None = None, timeout: float | None = None
) -> pb.GetStatsResponse:
    """Blocking: one GetStats call."""
    channel = grpc.secure_channel(address, tls.credentials()) if tls else grpc.insecure_channel(address)
    try:
        stub = pb_grpc.GenerationServiceStub(channel)
        return stub.GetStats(pb.GetStatsRequest(), timeout=timeout, metadata=auth_metadata(token))
    finally:
        channel.close()
