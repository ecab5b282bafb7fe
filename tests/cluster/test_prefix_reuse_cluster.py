"""Decode-side prefix reuse through the whole service on local Ray (ray and nixl transports, codec none): a
multi-turn conversation (turn k's prompt = turn k-1's prompt + answer + new user text) streams the
colocated engine's tokens; from turn 2 the KV shipped is exactly the blocks the decode actor lacks."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from bench.serving.metrics import scrape
from deploy.running import start_cluster
from engine.model.config import ModelConfig
from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
from engine import SamplingParams

from cluster_helpers import cluster_config

BLOCK_SIZE = 16
MAX_TOKENS = 8


async def _turn(stub, rid: str, prompt: list[int]) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [m async for m in stub.Generate(req)]


async def _kv_bytes_after(url: str, expected: float, timeout: float = 10.0) -> float:
    """The router's KV-bytes counter once it reaches `expected` (the prefill result may land after the
    last token), or its value when `timeout` passes."""
    end = time.monotonic() + timeout
    while True:
        value = scrape(url)["kv_bytes"]
        if value >= expected or time.monotonic() > end:
            return value
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("transport", ["ray", "nixl"])
def test_multi_turn_conversation_ships_only_new_blocks(ray_local, tiny_model_dir, reference, transport):
    if transport == "nixl":
        from kv_transfer.transports.nixl.agent import available
        if available() is not None:
            pytest.skip(available())
    block_bytes = ModelConfig.from_dir(tiny_model_dir).kv_bytes_per_token(4) * BLOCK_SIZE   # float32
    cfg = cluster_config(tiny_model_dir, transport, "none")
    cfg.server.metrics_port = 0
    g = torch.Generator().manual_seed(21)
    users = [torch.randint(2, 1000, (n,), generator=g).tolist() for n in (40, 13, 19, 7)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def main():
        cluster = await start_cluster(cfg, port=0)
        try:
            await cluster.server.wait_ready(60)
            url = cluster.metrics_url
            async with grpc.aio.insecure_channel(cluster.address) as channel:
                stub = pb_grpc.GenerationServiceStub(channel)
                prompt, previous, shipped_total = users[0], None, 0.0
                for k in range(len(users)):
                    if previous is not None:
                        prompt = previous[0] + previous[1] + users[k]
                    msgs = await _turn(stub, f"turn-{k}", prompt)
                    tokens = [t for m in msgs for t in m.token_ids]
                    assert tokens == reference([prompt], [params])[0], f"turn {k}"
                    # the decode actor cached the previous prompt and all its answer but the last token's KV
                    pinned = 0 if previous is None else min((len(previous[0]) + MAX_TOKENS - 1) // BLOCK_SIZE,
                                                            (len(prompt) - 1) // BLOCK_SIZE)
                    shipped = -(-len(prompt) // BLOCK_SIZE) - pinned
                    shipped_total += shipped * block_bytes
                    assert await _kv_bytes_after(url, shipped_total) == shipped_total, f"turn {k}"
                    assert k == 0 or shipped <= 2
                    # cached_tokens: the prompt tokens the prefill actor did not compute (its own cache)
                    prefill_hits = 0 if previous is None else len(previous[0]) // BLOCK_SIZE * BLOCK_SIZE
                    assert msgs[-1].usage.cached_prompt_tokens == prefill_hits, f"turn {k}"
                    previous = (prompt, tokens)
                stats = None
                for _ in range(50):                      # blocks come back as the streams close
                    stats = await pb_grpc.GenerationServiceStub(channel).GetStats(pb.GetStatsRequest())
                    if all(a.kv_blocks_used == 0 for a in stats.actors):
                        break
                    await asyncio.sleep(0.1)
                assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
        finally:
            await cluster.stop()
    asyncio.run(main())
