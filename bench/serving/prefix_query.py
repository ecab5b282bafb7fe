"""What decode-side prefix reuse adds to a request's dispatch: the router's `PrefixQuery` to its
decode actor (one actor call before the jobs go out), timed from the router's own process.

Starts a tiny embedded cluster (1 prefill + 1 decode actor), sends `--calls` queries of
`--hashes` chained block hashes through the router's actor client, and prints the round trip.

    python -m bench.serving.prefix_query [--calls 100] [--hashes 60]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time

from proto.pdserve.v1 import worker_pb2 as wpb


async def measure(calls: int, num_hashes: int) -> list[float]:
    from bench.serving.cluster import bench_config, init_local_ray
    from deploy.running import start_cluster
    cfg = bench_config(None, "tiny", "float32", ["pools.prefill.resources.num_cpus=0.5",
                                                 "pools.decode.resources.num_cpus=0.5"])
    init_local_ray(cfg, 2)
    cluster = await start_cluster(cfg, port=0)
    try:
        if not await cluster.server.wait_ready(300):
            raise RuntimeError("the cluster did not become ready")
        client = cluster.backend.pools.decode[0].client
        query = wpb.PrefixQuery(block_hashes=[os.urandom(16) for _ in range(num_hashes)])
        for _ in range(5):                       # warm the call path
            await client.cached_prefix(query)
        seconds = []
        for _ in range(calls):
            start = time.perf_counter()
            await client.cached_prefix(query)
            seconds.append(time.perf_counter() - start)
        return sorted(seconds)
    finally:
        await cluster.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving.prefix_query", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--hashes", type=int, default=60, help="block hashes per query (60: a ~1000-token prompt)")
    args = p.parse_args(argv)
    s = asyncio.run(measure(args.calls, args.hashes))
    pick = lambda q: 1e3 * s[min(len(s) - 1, int(q * len(s)))]     # noqa: E731
    print(f"prefix query round trip ({args.hashes} hashes, {len(s)} calls, Ray actor call): "
          f"p50 {pick(0.5):.2f} ms, p90 {pick(0.9):.2f} ms, p99 {pick(0.99):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
