"""Tensor parallelism (``pools.<pool>.tensor_parallel`` / ``EngineArgs.tensor_parallel``).

    shard.py            each rank's attention heads, KV heads and MLP slice; which rows / columns of each
                        checkpoint tensor it loads; the check that a degree fits the model
    group.py            the rank group of one actor (its store, NCCL on CUDA or gloo on CPU, every
                        collective under a timeout) and its all-reduce
    step_plan.py        rank 0's step plan (one model call and the cache edits before it) and the
                        channel the other ranks take it from
    tensor_parallel.py  one rank's part: shard + group + plan channel, `follow` and `close`
    reshard.py          which sending rank gives which KV-head range to which receiving rank between two
                        degrees, and that copy on cache tensors (the reference; transports do not ship
                        by head range yet)

A single rank is the no-op case: no group, no plans; the engine's code paths stay those of one device.
"""
