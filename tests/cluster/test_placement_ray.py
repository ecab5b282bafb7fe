"""Actors Ray cannot place, on a local Ray with 2 CPUs: three actors of 1 CPU
fit by fractional CPUs (said once in the log) and serve; an impossible custom resource fails
within ray.placement_timeout_s with an error naming the pool, what it asks and what Ray has."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from deploy.config import ConfigError, load_config
from deploy.running import start_cluster
from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc

NODE_CPUS = 2
START_LIMIT_S = 180          # the old launcher waited forever; a start that fits takes well under this


@pytest.fixture(scope="module")
def ray_two_cpus():
    """A local Ray with 2 CPUs for this module; the session's Ray (if any) comes back afterwards."""
    import ray

    from deploy.launcher import init_ray
    restore = int(ray.cluster_resources().get("CPU", 0)) if ray.is_initialized() else 0
    ray.shutdown()
    init_ray(num_cpus=NODE_CPUS)
    yield
    ray.shutdown()
    if restore:
        init_ray(num_cpus=restore)


class _Lines(logging.Handler):
    """Collects the launcher's log lines (whatever propagation other tests configured)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def launcher_log():
    logger = logging.getLogger("pdserve.deploy.launcher")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _config(model_dir: str, **overrides):
    base = {
        "model.name": model_dir, "model.dtype": "float32", "kv_cache.num_blocks": 128,
        "pools.prefill.count": 1, "pools.decode.count": 2,
        "pools.prefill.resources.num_cpus": 1, "pools.decode.resources.num_cpus": 1,
        "pools.prefill.resources.torch_threads": 1, "pools.decode.resources.torch_threads": 1,
        "kv_transfer.transport": "grpc", "kv_transfer.compression": "none", "model.attention": "eager",
    }
    return load_config(None, {**base, **overrides})


async def _generate(address: str, prompts: list[list[int]]) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)

        async def one(i: int, prompt: list[int]) -> list[int]:
            request = pb.GenerateRequest(request_id=f"p{i}", token_ids=pb.TokenIds(ids=prompt),
                                         sampling=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            return [t async for m in stub.Generate(request, timeout=60) for t in m.token_ids]
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_three_one_cpu_actors_fit_two_cpus_by_fractions_and_serve(ray_two_cpus, tiny_model_dir, reference,
                                                                 launcher_log):
    import ray
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23]]

    async def main():
        cluster = await asyncio.wait_for(start_cluster(_config(tiny_model_dir), port=0), START_LIMIT_S)
        try:
            assert await cluster.server.wait_ready(30)
            return await _generate(cluster.address, prompts), ray.available_resources().get("CPU", 0.0), \
                (len(cluster.backend.pools.prefill), len(cluster.backend.pools.decode))
        finally:
            await cluster.stop()

    outputs, free_cpus, sizes = asyncio.run(main())
    from engine import SamplingParams
    assert outputs == reference(prompts, [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 3)
    assert sizes == (1, 2)
    assert free_cpus < 0.01                         # 3 x 0.6666 of the 2 CPUs
    fitted = [line for line in launcher_log if "local Ray has 2 CPUs" in line]
    assert len(fitted) == 1 and "ask for 3" in fitted[0] and "0.6666" in fitted[0], launcher_log


def test_an_impossible_custom_resource_fails_within_the_deadline_naming_the_pool(ray_two_cpus, tiny_model_dir):
    import ray
    cfg = _config(tiny_model_dir, **{"pools.decode.count": 1, "pools.decode.resources.custom": {"decode_node": 1},
                                     "ray.placement_timeout_s": 3})
    start = time.monotonic()
    with pytest.raises(ConfigError) as exc:
        asyncio.run(asyncio.wait_for(start_cluster(cfg, port=0), START_LIMIT_S))
    elapsed = time.monotonic() - start

    message = str(exc.value)
    assert exc.value.key == "pools.decode.resources"
    assert "pools.decode" in message and "ray.placement_timeout_s = 3 s" in message
    assert "asks CPU 1, decode_node 1" in message                # what one actor asks
    assert "has CPU 2, GPU 0, decode_node 0 in total" in message  # what the cluster has
    assert elapsed < 3 + 30
    _wait_no_live_actors(ray)                                     # the batch was killed, nothing left waiting


def _wait_no_live_actors(ray, timeout: float = 30.0) -> None:
    from ray._private import state
    end = time.monotonic() + timeout
    while True:
        live = [a for a in state.actors().values() if a.get("State") != "DEAD"]
        if not live:
            return
        assert time.monotonic() < end, live
        time.sleep(0.1)
