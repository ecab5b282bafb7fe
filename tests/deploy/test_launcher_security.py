"""What the launcher hands the actors (deploy/launcher.py): the secret derived from the token, never the
token (a KV service and a token stream built from it refuse the public token), and the internal TLS."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import torch

from decode_worker.stream_service import DecodeStreamClient, DecodeStreamServer
from deploy.config import load_config
from deploy.launcher import ActorFactory, transfer_settings
from kv_transfer import KVLayout, SimpleBlockPool, make_receiver
from proto.internal_auth import internal_secret
from proto.pdserve.v1 import worker_pb2 as wpb
from tls_support import handshake_code

PUBLIC = "public-token"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, block_size=4, head_dim=8, dtype=torch.float32, model_fingerprint="t")


def _handshake_code(endpoint: str, token: str) -> grpc.StatusCode:
    return handshake_code(grpc.insecure_channel(endpoint), LAYOUT, token, "fp8")


def test_kv_service_takes_the_derived_secret_and_refuses_the_public_token(model_dir):
    cfg = load_config(None, {"model.name": model_dir, "security.token": PUBLIC})
    settings = transfer_settings(cfg, PUBLIC, "127.0.0.1")
    assert settings.token == internal_secret(PUBLIC) and settings.tls is None
    receiver = make_receiver(settings, LAYOUT, torch.zeros(LAYOUT.cache_shape(4)), SimpleBlockPool(4))
    try:
        assert _handshake_code(receiver.endpoint, PUBLIC) == grpc.StatusCode.UNAUTHENTICATED
        assert _handshake_code(receiver.endpoint, internal_secret(PUBLIC)) == grpc.StatusCode.OK
    finally:
        receiver.close()


def test_token_stream_takes_the_derived_secret_and_refuses_the_public_token(model_dir, pem_files):
    cfg = load_config(None, {"model.name": model_dir, "security.token": PUBLIC,
                             "security.internal_tls_cert": pem_files["cert.pem"],
                             "security.internal_tls_key": pem_files["key.pem"],
                             "security.internal_tls_ca": pem_files["ca.pem"]})
    factory = ActorFactory(cfg, PUBLIC)
    assert factory.token == factory.streams.token == factory.transfer.token == internal_secret(PUBLIC)
    assert factory.streams.tls == factory.transfer.tls == cfg.security.internal_tls() is not None
    jobs = []

    class Worker:
        engine = SimpleNamespace(max_model_len=64)

        def submit(self, job, emit):
            jobs.append(job.request_id)
            emit(wpb.DecodeEvent(token_ids=[1], finish_reason=1))

        def abort(self, request_id):
            pass

    async def code(client: DecodeStreamClient, endpoint: str, request_id: str) -> grpc.StatusCode:
        try:
            async for _ in client.open(endpoint, wpb.DecodeJob(request_id=request_id)):
                pass
        except grpc.RpcError as exc:
            return exc.code()
        finally:
            await client.close()
        return grpc.StatusCode.OK

    async def main():
        server = DecodeStreamServer(Worker(), factory.token, "127.0.0.1")     # plaintext: the PEMs are placeholders
        endpoint = await server.start()
        try:
            assert await code(DecodeStreamClient(PUBLIC), endpoint, "public") == grpc.StatusCode.UNAUTHENTICATED
            assert await code(DecodeStreamClient(factory.token), endpoint, "derived") == grpc.StatusCode.OK
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert jobs == ["derived"]
