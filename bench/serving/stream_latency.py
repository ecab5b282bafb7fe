"""Which stream adds less per-token latency from a decode actor to the router: a Ray streaming
generator (what pdserve uses) or a gRPC server stream from the actor?

Both run between two processes on this machine: an actor yields `--tokens` small
events, one per `--interval-ms` (like decode steps); the consumer records the
delay between the producer's timestamp and its arrival.

    python -m bench.serving.stream_latency [--tokens 500] [--interval-ms 2]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import grpc

SERVICE = "/pdserve.bench.Stream/Tokens"


class _Producer:
    """Runs inside a Ray actor: a Ray streaming method and a gRPC server streaming the same events."""

    def __init__(self):
        self._server = None

    async def ray_stream(self, n: int, interval_s: float):
        for i in range(n):
            await asyncio.sleep(interval_s)
            yield (i, time.time())

    async def start_grpc(self) -> int:
        async def tokens(request: bytes, context):
            n, interval_ms = map(int, request.decode().split(","))
            for i in range(n):
                await asyncio.sleep(interval_ms / 1000)
                yield f"{i},{time.time()!r}".encode()
        handler = grpc.method_handlers_generic_handler("pdserve.bench.Stream", {
            "Tokens": grpc.unary_stream_rpc_method_handler(tokens)})
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((handler,))
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port


def _summary(delays: list[float]) -> dict:
    delays = sorted(delays)
    return {"p50_ms": statistics.median(delays) * 1e3, "p99_ms": delays[int(0.99 * (len(delays) - 1))] * 1e3,
            "mean_ms": statistics.fmean(delays) * 1e3}


async def _measure(actor, n: int, interval_ms: int) -> dict:
    ray_delays = []
    async for ref in actor.ray_stream.options(num_returns="streaming").remote(n, interval_ms / 1000):
        _, sent = await ref
        ray_delays.append(time.time() - sent)
    port = await actor.start_grpc.remote()
    grpc_delays = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(SERVICE)(f"{n},{interval_ms}".encode())
        async for msg in call:
            grpc_delays.append(time.time() - float(msg.decode().split(",")[1]))
    return {"ray_streaming_generator": _summary(ray_delays), "grpc_server_stream": _summary(grpc_delays)}


def main(argv: list[str] | None = None) -> int:
    import ray

    from deploy.launcher import init_ray
    ap = argparse.ArgumentParser(prog="pdserve bench stream_latency")
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--interval-ms", type=int, default=2)
    args = ap.parse_args(argv)
    init_ray(num_cpus=2)
    actor = ray.remote(_Producer).options(num_cpus=0).remote()
    result = asyncio.run(_measure(actor, args.tokens, args.interval_ms))
    print(f"{'stream':<26} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}   ({args.tokens} events, one per "
          f"{args.interval_ms} ms, actor -> driver)")
    for name, r in result.items():
        print(f"{name:<26} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['mean_ms']:>8.3f}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
