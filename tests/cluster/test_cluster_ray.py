"""The whole service on local Ray: gRPC in, prefill and decode pools, KV handoff, tokens out."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from deploy.running import start_cluster
from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc

from cluster_helpers import cluster_config, prompts_and_params


async def _generate_all(address, prompts, params):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        async def one(i, p, prm):
            req = pb.GenerateRequest(request_id=f"r{i}", token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
                max_tokens=prm.max_tokens, temperature=prm.temperature, ignore_eos=prm.ignore_eos))
            return [m async for m in stub.Generate(req)]
        return await asyncio.gather(*(one(i, p, prm) for i, (p, prm) in enumerate(zip(prompts, params))))


async def _stats(address):
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.GenerationServiceStub(channel).GetStats(pb.GetStatsRequest())


def _run(cfg, prompts, params):
    async def main():
        cluster = await start_cluster(cfg, port=0)
        try:
            await cluster.server.wait_ready(30)
            replies = await _generate_all(cluster.address, prompts, params)
            await asyncio.sleep(0.3)
            stats = await _stats(cluster.address)
            return replies, stats
        finally:
            await cluster.stop()
    return asyncio.run(main())


@pytest.mark.parametrize("transport,n,layerwise", [
    ("grpc", 1, True), ("grpc", 2, True), ("tcp", 1, True), ("torch", 1, True), ("torch", 2, True), ("ray", 1, True),
    ("ray", 2, True), ("nixl", 1, True), ("nixl", 1, False)])
def test_disaggregated_equals_colocated(ray_local, tiny_model_dir, reference, transport, n, layerwise):
    if transport == "nixl":
        _skip_without_nixl()
    prompts, params = prompts_and_params(32, seed=11)
    cfg = cluster_config(tiny_model_dir, transport, "none", n, n, extra={"kv_transfer.layerwise": layerwise})
    replies, stats = _run(cfg, prompts, params)
    expected = reference(prompts, params)
    for i, msgs in enumerate(replies):
        assert [t for m in msgs for t in m.token_ids] == expected[i], f"request {i}"
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert msgs[-1].usage.completion_tokens == len(expected[i])
    assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
    assert len(stats.actors) == 2 * n


def _skip_without_nixl() -> None:
    from kv_transfer.transports.nixl.agent import available
    reason = available()
    if reason is not None:
        pytest.skip(reason)


def test_compiled_decode_attention_in_the_cluster(ray_local, tiny_model_dir, reference):
    """Decode actors on the compiled kernel (the CPU default; the suite otherwise pins eager) give
    the colocated engine's tokens exactly, with KV shipped in from a prefill actor."""
    prompts, params = prompts_and_params(16, seed=14)
    replies, stats = _run(cluster_config(tiny_model_dir, attention="compiled"), prompts, params)
    assert [[t for m in msgs for t in m.token_ids] for msgs in replies] == reference(prompts, params)
    assert all(a.kv_blocks_used == 0 for a in stats.actors), stats


@pytest.mark.parametrize("chunked", [True, False])
def test_colocated_mode_equals_engine(ray_local, tiny_model_dir, reference, chunked):
    from deploy.running import start_cluster
    prompts, params = prompts_and_params(8, seed=12)
    cfg = cluster_config(tiny_model_dir)

    async def main():
        cluster = await start_cluster(cfg, port=0, mode="colocated", chunked=chunked)
        try:
            await cluster.server.wait_ready(30)
            return await _generate_all(cluster.address, prompts, params), await _stats(cluster.address)
        finally:
            await cluster.stop()
    replies, stats = asyncio.run(main())
    assert [[t for m in msgs for t in m.token_ids] for msgs in replies] == reference(prompts, params)
    assert {a.role for a in stats.actors} == {pb.ACTOR_ROLE_COLOCATED}


def test_fp8_run_completes_and_mostly_agrees(ray_local, tiny_model_dir, reference):
    prompts, params = prompts_and_params(32, seed=13)
    replies, stats = _run(cluster_config(tiny_model_dir, "grpc", "fp8"), prompts, params)
    expected = reference(prompts, params)
    got = [[t for m in msgs for t in m.token_ids] for msgs in replies]
    assert [len(g) for g in got] == [len(e) for e in expected]
    assert all(msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH for msgs in replies)
    agree = sum(next((k for k, (a, b) in enumerate(zip(g, e)) if a != b), len(e)) for g, e in zip(got, expected))
    print(f"fp8 cluster run: greedy prefix agreement {agree / sum(map(len, expected)):.3f}")
    assert agree > 0
    assert all(a.kv_blocks_used == 0 for a in stats.actors)
