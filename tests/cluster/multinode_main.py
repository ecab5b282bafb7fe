"""Run by test_multinode.py in its own process (its own Ray): a `ray.cluster_utils.Cluster`
with two simulated nodes on 127.0.0.1 — `prefill_node` and `decode_node` custom resources —
then, per transport, start pdserve against it (`ray.address` set, so the KV receivers bind to
the node's address), generate greedily, and print one JSON line: token ids, each actor's
node, the nodes, and the listening sockets of the actor processes."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"       # node ip = 127.0.0.1
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def listeners(pids: set[int]) -> list[tuple[int, str]]:
    """(pid, local address) of every listening TCP socket owned by `pids`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                found.append((pid, fields[3]))
    return found


def main(model_dir: str, transports: list[str]) -> None:
    import grpc
    import ray
    from ray._private import state
    from ray.cluster_utils import Cluster

    from deploy.config import load_config
    from deploy.running import start_cluster
    from proto.pdserve.v1 import generation_pb2 as pb
    from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"prefill_node": 2}, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    decode_node = cluster.add_node(num_cpus=1, resources={"decode_node": 2}, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    nodes = {"prefill_node": cluster.head_node.node_id, "decode_node": decode_node.node_id}
    prompts = json.loads(sys.stdin.read())
    report = {"nodes": nodes, "runs": {}}
    try:
        for transport in transports:
            cfg = load_config(None, {
                "model.name": model_dir, "model.dtype": "float32", "ray.address": cluster.address,
                "pools.prefill.count": 2, "pools.decode.count": 2,
                "pools.prefill.resources": {"num_cpus": 0.5, "torch_threads": 1, "custom": {"prefill_node": 1}},
                "pools.decode.resources": {"num_cpus": 0.5, "torch_threads": 1, "custom": {"decode_node": 1}},
                "kv_cache.num_blocks": 256, "kv_transfer.transport": transport, "kv_transfer.compression": "none"})

            async def run():
                running = await start_cluster(cfg, port=0)
                try:
                    await running.server.wait_ready(60)
                    async with grpc.aio.insecure_channel(running.address) as channel:
                        stub = pb_grpc.GenerationServiceStub(channel)

                        async def one(i, p):
                            req = pb.GenerateRequest(request_id=f"r{i}", token_ids=pb.TokenIds(ids=p["ids"]),
                                                     sampling=pb.SamplingParams(max_tokens=p["max_tokens"],
                                                                                temperature=0.0, ignore_eos=True))
                            return [t async for m in stub.Generate(req) for t in m.token_ids]
                        outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
                    b = running.backend
                    placed = {}
                    for pool, views in (("prefill", b.pools.prefill), ("decode", b.pools.decode)):
                        infos = [state.actors(v.client.handle._actor_id.hex()) for v in views]
                        placed[pool] = [info["Address"]["NodeID"] for info in infos]
                        placed[pool + "_pids"] = [info["Pid"] for info in infos]
                    pids = set(placed["prefill_pids"] + placed["decode_pids"])
                    endpoints = [v.endpoint for v in b.pools.decode]
                    return {"outputs": outputs, "placed": placed, "endpoints": endpoints,
                            "listeners": listeners(pids)}
                finally:
                    await running.stop()
            report["runs"][transport] = asyncio.run(run())
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
