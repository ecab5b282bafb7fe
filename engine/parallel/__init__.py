"""Tensor parallelism (``pools.<pool>.tensor_parallel``); nothing here yet.

What goes here: the rank group of one actor (one process per rank; NCCL on CUDA, gloo on CPU, every
collective under a timeout), the split of attention heads and KV heads across ranks and of the MLP
across its intermediate size, rank 0's step plan that the other ranks follow, and the resharding of
KV blocks by head range when prefill and decode run different degrees. A single rank is the no-op case:
the engine's code paths stay those of one device.
"""
