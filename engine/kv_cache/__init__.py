"""The paged KV cache's bookkeeping: blocks, the prefix cache, its events and the cache's size.

    block_manager.py   BlockManager: blocks with reference counts, the prefix cache of chained block hashes
    events.py          KVEventLog: the prefix cache's stored/removed events, numbered for the router
    prompt_kv.py       prompt KV that crossed a lossy transfer codec, and its recomputation
    memory_budget.py   the cache's size from the device's memory (CUDA)
    tiers/             host memory and disk below the paged cache: offload on eviction, onboard before prefill

The cache tensor itself, ``[num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]``, is the
engine's (`Engine.kv_cache`); the model reads and writes it through the block tables kept here.
"""
