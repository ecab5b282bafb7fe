"""KV tiers through the whole service on local Ray: a prompt whose blocks every actor evicted comes back
from each actor's tier (prefill, decode and colocated actors), its tokens equal to the colocated engine's,
the decode actor onboarding what the transfer then skips; the router's index follows the blocks into
each actor's tier (from the actors' events); GetStats shows each actor's tiers."""
from __future__ import annotations

import grpc
import pytest
import torch

from cluster_helpers import ClusterThread, cluster_config, wait_blocks_free
from engine.kv_cache.block_manager import prompt_block_hashes
from proto.pdserve.v1 import kv_events_pb2 as kpb
from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
from engine import SamplingParams
from waiting import wait_until

MAX_TOKENS = 4
NUM_HIT_TOKENS = 9 * 16                 # a 150-token prompt's full blocks, all but the last token's


def _generate(stub, rid: str, prompt: list[int]) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return list(stub.Generate(req, timeout=120))


async def _holders(index, hashes: set[bytes], tier_id: int) -> tuple[list[str], bool]:
    """The actors whose tier `tier_id` holds every one of `hashes` in the index, and whether any paged cache
    still holds one."""
    return (sorted(a for a in index.actor_ids if hashes <= index.hashes_of(a, tier_id)),
            any(hashes & index.hashes_of(a) for a in index.actor_ids))


@pytest.mark.parametrize("mode, kind", [("disaggregated", "host"), ("disaggregated", "disk"),
                                        ("colocated", "host")])
def test_evicted_prompt_comes_back_from_every_actors_tier(ray_local, tiny_model_dir, reference, tmp_path,
                                                          mode, kind):
    tier = {"kind": kind, "capacity_gib": 0.05, **({"path": str(tmp_path)} if kind == "disk" else {})}
    cfg = cluster_config(tiny_model_dir, "grpc", "none", attention="eager",
                         extra={"kv_cache.num_blocks": 24, "kv_cache.tiers": [tier]})
    g = torch.Generator().manual_seed(5)
    prompt, *fillers = [torch.randint(2, 1000, (150,), generator=g).tolist() for _ in range(5)]
    expected = reference([prompt], [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)])[0]
    cluster = ClusterThread(cfg, mode=mode)
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            first = _generate(stub, "first", prompt)
            for i, filler in enumerate(fillers):                 # 10 blocks each: the prompt leaves every cache
                _generate(stub, f"filler-{i}", filler)
            # the router's index follows the blocks into the tiers (read on the router's own loop)
            hashes = set(prompt_block_hashes(prompt, 16)[:9])
            tier_id = kpb.KV_CACHE_TIER_HOST if kind == "host" else kpb.KV_CACHE_TIER_DISK
            num_holders = 2 if mode == "disaggregated" else 1

            def tier_holders() -> list[str] | None:
                holders, on_device = cluster.call(_holders(cluster.cluster.backend.kv_index, hashes, tier_id))
                return holders if len(holders) == num_holders and not on_device else None
            wait_until(tier_holders, timeout=30)
            holders = tier_holders()
            again = _generate(stub, "again", prompt)
            assert [t for m in first for t in m.token_ids] == expected
            assert [t for m in again for t in m.token_ids] == expected
            assert again[-1].usage.cached_prompt_tokens == NUM_HIT_TOKENS      # onboarded, not recomputed
            stats = wait_blocks_free(cluster.address)
            assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
            assert all([t.kind for t in actor.kv_tiers] == [kind] for actor in stats.actors), stats
            served = [a for a in stats.actors if a.kv_tiers[0].offload_bytes]    # (colocated: one of two serves)
            assert len(served) == (2 if mode == "disaggregated" else 1), stats    # prefill and decode actor
            assert holders == sorted(a.actor_id for a in served)
            for actor in served:                     # each served its hit from its own tier
                t = actor.kv_tiers[0]
                assert t.enabled and t.onboard_bytes > 0 and t.hit_rate > 0, actor
    finally:
        cluster.stop()
