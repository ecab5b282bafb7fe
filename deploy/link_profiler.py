"""The KV link's figure for the planner's network term: a prompt's KV through the configured transport.

`pdserve profile` runs it beside the engine points. A receiver and a sender of
``kv_transfer.transport`` with ``kv_transfer.compression`` run in this process on
127.0.0.1, over caches of the decode pool's KV layout and dtype; the blocks of one
mean-length prompt go across ``reps`` times after a warm-up send, and the best time
counts (on a shared machine other work only adds time). The figure is effective KV
bytes/s: the cache's KV bytes ÷ the whole send, encode and decode included (with an fp8 /
int8 cache, its stored bytes, shipped as they are). It is this
host's loopback, with both ends in one process: between nodes, give the link's
bandwidth as ``kv_transfer.link_gbps`` instead.

    {"transport", "codec", "kv_bytes", "wire_bytes", "seconds", "kv_bytes_per_s", "where": "loopback"}
    or {"transport", "codec", "error": "..."} when the transport could not be measured here
"""
from __future__ import annotations

import time

import torch

from deploy.config import PDServeConfig
from deploy.launcher import engine_args
from engine.model.config import ModelConfig
from engine.engine import pick_dtype

TOKEN = "pdserve-link-profile"


def measure_link(cfg: PDServeConfig, model_dir: str, reps: int = 3, timeout_s: float = 120.0) -> dict:
    """Send one mean-length prompt's KV blocks ``reps`` times over the configured transport (see the module)."""
    from kv_transfer import (KVLayout, KVPiece, SimpleBlockPool, TransferStatus, codec_compiled, make_receiver,
                             make_sender)

    t, codec = cfg.kv_transfer, cfg.transfer_codec()
    result: dict = {"transport": t.transport, "codec": codec, "where": "loopback"}
    args = engine_args(cfg, "decode", model_dir)
    mcfg = ModelConfig.from_dir(model_dir)
    dtype = pick_dtype(cfg.model.dtype, torch.device("cpu"))
    layout = KVLayout(mcfg.num_hidden_layers, mcfg.num_key_value_heads, args.block_size, mcfg.head_dim, dtype,
                      "link-profile", args.kv_cache_dtype)
    num_blocks = -(-cfg.workload.input_tokens_mean // args.block_size)
    pool = SimpleBlockPool(num_blocks)
    if layout.quantized:     # the cache's own cells (their bytes do not matter to the link)
        src = torch.randint(0, 256, layout.cache_shape(num_blocks), dtype=torch.uint8)
    else:
        src = torch.randn(layout.cache_shape(num_blocks)).to(dtype)
    dst = torch.zeros_like(src)
    receiver = sender = None
    try:
        nixl = t.nixl.options() if t.transport == "nixl" else {}
        receiver = make_receiver(t.transport, layout, dst, pool, codec=codec, token=TOKEN,
                                 on_complete=lambda r: pool.free(r.dst_block_ids) if r.dst_block_ids else None, **nixl)
        sender = make_sender(t.transport, layout, codec=codec, token=TOKEN, chunk_bytes=t.chunk_bytes, **nixl)
        sender.codec.prepare(src)
        codec_compiled.wait_ready(timeout_s)  # measure the codec a warm serving process runs
        best, wire_bytes = float("inf"), 0
        for rep in range(reps + 1):
            piece = KVPiece(f"link-{rep}", src, list(range(num_blocks)), deadline_s=timeout_s)
            handle = sender.send(piece, receiver.endpoint)
            if handle.wait(timeout_s) != TransferStatus.DONE:
                raise RuntimeError(f"transfer failed: {handle.error or handle.status.value}")
            if receiver.wait(handle.transfer_id, timeout_s) is None:
                raise RuntimeError("the receiver did not finish the transfer")
            if rep:  # the first send warms connections and kernels up
                best, wire_bytes = min(best, handle.elapsed_s), handle.wire_bytes
        kv_bytes = num_blocks * layout.block_nbytes
        result.update(kv_bytes=kv_bytes, wire_bytes=wire_bytes, seconds=best, kv_bytes_per_s=kv_bytes / best)
    except Exception as exc:  # e.g. ray without a running Ray: the plan then says the term is missing
        result["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.close()
    result["measured"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return result
