"""Autoscaler on local Ray: a load step makes the decode pool (count: auto, 1..2) grow, and it
shrinks (drain, then kill) once the load drops; every request's greedy output equals the
colocated Engine and no KV block is left allocated."""
from __future__ import annotations

import asyncio
import time

import grpc

from deploy.autoscaler import AutoscaleSettings
from deploy.config import load_config
from deploy.running import start_cluster
from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc

from cluster_helpers import prompts_and_params


def _config(model_dir: str):
    return load_config(None, {
        "model.name": model_dir, "model.dtype": "float32",
        "pools.prefill.count": 1, "pools.prefill.resources.num_cpus": 0.5,
        "pools.prefill.resources.torch_threads": 1,
        "pools.decode.count": "auto", "pools.decode.min": 1, "pools.decode.max": 2,
        "pools.decode.resources.num_cpus": 0.5, "pools.decode.resources.torch_threads": 1,
        "pools.decode.max_batch_size": 2,           # a small planned batch: the backlog shows at once
        "kv_cache.num_blocks": 512, "kv_transfer.transport": "grpc", "kv_transfer.compression": "none",
        "workload.input_tokens_mean": 100, "workload.output_tokens_mean": 16, "workload.arrival_rate_rps": 0.1,
    })


class Load:
    """Closed-loop load: `concurrency` clients, each sending the next prompt when its last one ends."""

    def __init__(self, address: str, prompts, params):
        self.address, self.prompts, self.params = address, prompts, params
        self.next = 0
        self.replies: dict[int, list] = {}
        self.concurrency = 0

    async def client(self, stub, stop: asyncio.Event, slot: int) -> None:
        while not stop.is_set() and slot < self.concurrency and self.next < len(self.prompts):
            i, self.next = self.next, self.next + 1
            p, prm = self.prompts[i], self.params[i]
            req = pb.GenerateRequest(request_id=f"r{i}", token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
                max_tokens=prm.max_tokens, temperature=0.0, ignore_eos=True))
            self.replies[i] = [m async for m in stub.Generate(req)]

    async def run(self, concurrency: int, until) -> None:
        """Run `concurrency` clients until `until()` is true (checked every 50 ms)."""
        self.concurrency = concurrency
        stop = asyncio.Event()
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            tasks = [asyncio.ensure_future(self.client(stub, stop, s)) for s in range(concurrency)]
            deadline = time.monotonic() + 60
            while not until() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.gather(*tasks)


async def _blocks_free(address: str, timeout: float = 10.0):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        end = time.monotonic() + timeout
        while True:
            stats = await stub.GetStats(pb.GetStatsRequest())
            if all(a.kv_blocks_used == 0 for a in stats.actors) or time.monotonic() > end:
                return stats
            await asyncio.sleep(0.1)


def test_load_step_grows_then_drains_decode_pool(ray_local, tiny_model_dir, reference):
    prompts, params = prompts_and_params(400, seed=21, max_len=120)
    settings = AutoscaleSettings(interval_s=0.3, window_s=1.5, scale_down_after=3, drain_timeout_s=30)

    async def main():
        cluster = await start_cluster(_config(tiny_model_dir), port=0, autoscale=settings)
        sizes: list[int] = []

        async def sample():
            while True:
                sizes.append(len(cluster.backend.pools.decode))
                await asyncio.sleep(0.05)
        sampler = asyncio.ensure_future(sample())
        try:
            await cluster.server.wait_ready(30)
            load = Load(cluster.address, prompts, params)
            decode = cluster.backend.pools.decode
            await load.run(1, lambda: load.next >= 3)                      # quiet: stays at min
            quiet_max = max(sizes)
            grown_at = {}

            def grown_and_used():
                if len(decode) == 2 and "n" not in grown_at:
                    grown_at["n"] = load.next
                return "n" in grown_at and load.next >= grown_at["n"] + 16
            await load.run(8, grown_and_used)                              # the load step
            grew = len(decode) == 2
            await load.run(1, lambda: len(decode) == 1 and not any(v.draining for v in decode))
            await load.run(1, lambda: load.next >= grown_at.get("n", 0) + 24)   # keeps serving after the drain
            stats = await _blocks_free(cluster.address)
            return load, quiet_max, grew, len(decode), stats, cluster.autoscaler.history
        finally:
            sampler.cancel()
            await cluster.stop()

    load, quiet_max, grew, final, stats, history = asyncio.run(main())
    assert quiet_max == 1
    assert grew, [d.targets for d in history][-10:]
    assert final == 1
    assert all(1 <= d.sizes["decode"] <= 2 for d in history)
    done = sorted(load.replies)
    assert done == list(range(len(done))) and len(done) >= 30
    expected = reference([prompts[i] for i in done], [params[i] for i in done])
    for i, want in zip(done, expected):
        msgs = load.replies[i]
        assert [t for m in msgs for t in m.token_ids] == want, f"request {i}"
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(a.kv_blocks_used == 0 for a in stats.actors), stats
