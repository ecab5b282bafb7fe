"""Role flips on local Ray (routing.role_flips): actors switch prefill <-> decode <-> colocated while
requests stream; every request's tokens equal the colocated engine's, no KV block is left held."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from deploy.autoscaler import AutoscaleSettings
from deploy.running import start_cluster
from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc

from cluster_helpers import cluster_config, prompts_and_params


async def _generate_all(address, prompts, params, prefix, together: int = 1):
    """Every prompt's reply; the first `together` arrive at once (in flight together, they are placed on
    different actors however fast the host serves them), the rest as a stream, 50 ms apart."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        async def one(i, p, prm):
            await asyncio.sleep(0.05 * max(i - together + 1, 0))     # a stream of arrivals, not one burst
            sampling = pb.SamplingParams(max_tokens=prm.max_tokens, temperature=prm.temperature,
                                         ignore_eos=prm.ignore_eos)
            req = pb.GenerateRequest(request_id=f"{prefix}{i}", token_ids=pb.TokenIds(ids=p), sampling=sampling)
            return [m async for m in stub.Generate(req)]
        return await asyncio.gather(*(one(i, p, prm) for i, (p, prm) in enumerate(zip(prompts, params))))


async def _wait_for(condition, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.01)


async def _running_on(view, count: int, timeout: float = 30.0) -> None:
    """Until the actor itself reports `count` requests in its running batch."""
    end = time.monotonic() + timeout
    while (await view.client.handle.stats.remote())["running_requests"] < count:
        assert time.monotonic() < end, f"{view.actor_id} never ran {count} requests"
        await asyncio.sleep(0.005)


async def _blocks_free(backend, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while True:
        stats = await backend.stats()
        if all(s.kv_blocks_used == 0 for s in stats) or time.monotonic() > end:
            return stats
        await asyncio.sleep(0.05)


def _tokens(replies):
    return [[t for m in msgs for t in m.token_ids] for msgs in replies]


def _view(pools, actor_id):
    return next(v for v in pools if v.actor_id == actor_id)


@pytest.mark.timeout(300)
def test_flips_under_load_lose_no_request_and_leak_no_block(ray_local, tiny_model_dir, reference):
    cfg = cluster_config(tiny_model_dir, "grpc", "none", n_prefill=1, n_decode=2, role_flips="manual")
    prompts, params = prompts_and_params(16, seed=21, max_len=200)
    later, later_params = prompts_and_params(6, seed=22, max_len=200)
    extra, extra_params = prompts_and_params(8, seed=23, max_len=200)

    async def main():
        cluster = await start_cluster(cfg, port=0)
        backend, manager = cluster.backend, cluster.manager
        pools = backend.pools
        try:
            await cluster.server.wait_ready(60)
            load = asyncio.ensure_future(_generate_all(cluster.address, prompts, params, "a", together=4))
            # each flip while the actor holds work of its old role
            await _wait_for(lambda: _view(pools.decode, "decode-1").running > 0)
            flips = [await manager.flip("decode-1", "prefill")]          # its decode requests finish first
            await _wait_for(lambda: _view(pools.prefill, "prefill-0").queued_tokens > 0)
            flips.append(await manager.flip("prefill-0", "decode"))      # its prefill sends complete first
            # more arrivals, so decode-0 holds requests for the third flip even when the first load has
            # drained during the second (a fast host can finish it in the 0.4 s that flip took)
            more = asyncio.ensure_future(_generate_all(cluster.address, extra, extra_params, "c"))
            await _running_on(_view(pools.decode, "decode-0"), 2)     # in its engine, not only routed there
            flips.append(await manager.flip("decode-0", "colocated", timeout_s=0.0))   # hands off at once
            first = await load + await more
            roles = {s.actor_id: s.role for s in await backend.stats()}
            # now decode-1 is the only prefill actor, prefill-0 decodes, decode-0 is colocated
            second = await _generate_all(cluster.address, later, later_params, "b")
            stats = await _blocks_free(backend)
            prefill_ids = [v.actor_id for v in pools.prefill]
            await manager.flip("prefill-0", "prefill")
            with pytest.raises(ValueError, match="last decode actor"):
                await manager.flip("decode-0", "prefill")
            with pytest.raises(ValueError, match="role must be one of"):
                await manager.flip("decode-0", "router")
            with pytest.raises(KeyError):
                await manager.flip("decode-9", "prefill")
            return flips, first, second, roles, stats, prefill_ids, [v.actor_id for v in pools.decode]
        finally:
            await cluster.stop()

    flips, first, second, roles, stats, prefill_ids, decode_ids = asyncio.run(main())
    assert _tokens(first) == reference(prompts + extra, params + extra_params)
    assert _tokens(second) == reference(later, later_params)
    assert all(msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH for msgs in first + second)
    assert roles == {"decode-1": pb.ACTOR_ROLE_PREFILL, "prefill-0": pb.ACTOR_ROLE_DECODE,
                     "decode-0": pb.ACTOR_ROLE_COLOCATED}
    assert prefill_ids == ["decode-1"] and decode_ids == ["decode-0"]
    assert all(s.kv_blocks_used == 0 for s in stats), stats
    assert [(f.from_role, f.to_role) for f in flips] == [("decode", "prefill"), ("prefill", "decode"),
                                                        ("decode", "colocated")]
    for f in flips:
        print(f"flip {f.actor_id} {f.from_role} -> {f.to_role}: {f.seconds:.2f}s "
              f"({f.drain_s:.2f}s draining, {f.handed_off} handed off)")
    assert flips[0].handed_off == 0 and flips[1].handed_off == 0 and flips[2].handed_off > 0


@pytest.mark.timeout(300)
def test_auto_mode_flips_the_last_prefill_actor_to_decode_when_no_prompt_needs_one(ray_local, tiny_model_dir,
                                                                                     reference):
    """routing.mode auto + role_flips auto, with SLOs every local prefill keeps: no prompt needs a prefill
    actor, so the autoscaler takes the prefill pool to zero while requests stream, and both actors then
    decode and prefill their own prompts (the colocated layout)."""
    cfg = cluster_config(tiny_model_dir, "grpc", "none", n_prefill=1, n_decode=1, role_flips="auto", mode="auto",
                         extra={"slo.ttft_p99_ms": 60000, "slo.tpot_p99_ms": 10000})
    settings = AutoscaleSettings(interval_s=0.2, window_s=10.0)
    prompts, params = prompts_and_params(24, seed=31, max_len=200)
    later, later_params = prompts_and_params(8, seed=32, max_len=200)

    async def main():
        cluster = await start_cluster(cfg, port=0, autoscale=settings)
        backend, pools = cluster.backend, cluster.backend.pools
        try:
            await cluster.server.wait_ready(60)
            load = asyncio.ensure_future(_generate_all(cluster.address, prompts, params, "a"))
            await _wait_for(lambda: not pools.prefill and len(pools.decode) == 2, timeout=60)
            first = await load
            second = await _generate_all(cluster.address, later, later_params, "b")
            stats = await _blocks_free(backend)
            flips = [d.flip for d in cluster.autoscaler.history if d.flip is not None]
            shares = [d.observation.remote_share for d in cluster.autoscaler.history if d.split is not None]
            return first, second, stats, flips, shares, sorted(v.actor_id for v in pools.decode)
        finally:
            await cluster.stop()

    first, second, stats, flips, shares, decode_ids = asyncio.run(main())
    assert _tokens(first) == reference(prompts, params)
    assert _tokens(second) == reference(later, later_params)
    assert decode_ids == ["decode-0", "prefill-0"]
    assert [(f.actor_id, f.from_role, f.to_role) for f in flips] == [("prefill-0", "prefill", "decode")]
    assert {s for s in shares if s is not None} == {0.0}          # every placed prompt kept its SLOs locally
    assert all(s.kv_blocks_used == 0 for s in stats), stats
