"""A tensor-parallel engine's other ranks as processes on this host (profiling without Ray, benchmarks, checks).

Serving runs each rank in a Ray actor (deploy/rank_actor.py); here rank 0 is built in the calling process
and ranks 1.. are spawned processes that build their shard and follow rank 0's step plans until it closes.
"""
from __future__ import annotations

import dataclasses
import multiprocessing

from engine.args import EngineArgs
from engine.engine import Engine
from engine.parallel.group import free_port


def follow_rank(args: EngineArgs) -> None:
    """A rank other than 0's whole life, in its own process: build the engine on its shard (`args`: the
    group's `EngineArgs` with this process's `tensor_parallel_rank`) and follow rank 0 until it closes."""
    Engine(args).follow()


def start_local_group(args: EngineArgs) -> tuple[Engine, list[multiprocessing.Process]]:
    """(rank 0's engine here, the started processes of ranks 1..) of `args.tensor_parallel` ranks; the group's
    store on a free loopback port unless `args` names one. Degree 1: the engine alone."""
    if args.tensor_parallel == 1:
        return Engine(args), []
    if args.tensor_parallel_address.endswith(":0"):
        args = dataclasses.replace(args, tensor_parallel_address=f"127.0.0.1:{free_port()}")
    ctx = multiprocessing.get_context("spawn")
    peers = [ctx.Process(target=follow_rank, args=(dataclasses.replace(args, tensor_parallel_rank=rank),),
                         daemon=True) for rank in range(1, args.tensor_parallel)]
    for peer in peers:
        peer.start()
    return Engine(args), peers
