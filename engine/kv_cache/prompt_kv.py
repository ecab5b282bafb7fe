"""Prompt KV that crosses a lossy KV codec, and its recomputation.

A disaggregated request decodes from prompt KV that went through the transfer codec (fp8): the
prefill actor computes it in full precision, the decode actor holds what the codec gave back. A
request that must recompute that prompt on a decode actor (preempted there, or migrated from a
decode actor that died) has to end up with the same KV, or its greedy stream may change. So:

- Every prompt whose KV is encoded has the unused tail of its last block zeroed before the chunk
  that completes the prompt runs (`zero_prompt_tails`): a block's fp8 scale is its amax, and the
  stale KV of an earlier request left in those slots must not move it.
- A request marked ``prompt_kv_lossy`` computes its whole prompt apart from its output tokens (the
  scheduler ends a chunk at the prompt's end), and each of its prompt blocks, once computed, is
  round-tripped through the codec (`roundtrip_prompt_blocks`) before anything attends to it in a
  later step, and before the prefix cache can hand it to another request. Output tokens then
  attend to the same lossy prompt KV as on the first decode actor.

Such a request takes no prefix-cache hits: the prefill side computed the prompt from exact KV,
and a decode actor's cached blocks hold the codec's version of it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.scheduling.request import Request

# Rewrites the given blocks of the KV cache ([L, NB, 2, H, B, D]) as the codec would deliver them.
Roundtrip = Callable[[torch.Tensor], None]


def encodes_prompt_kv(req: Request) -> bool:
    """Whether this request's prompt KV is (or stands for KV that was) encoded by the transfer codec."""
    return req.prefill_only or req.prompt_kv_lossy


def zero_prompt_tails(batch, zero_tail: Callable[[int, int], None], block_size: int) -> None:
    """Zero the slots after the prompt in its last block, for each chunk about to complete an encoded prompt.

    `zero_tail(block, first_slot)` zeroes them in the cache (the runner's, on every tensor-parallel rank)."""
    for s in batch:
        req = s.request
        if not encodes_prompt_kv(req):
            continue
        start, end = req.num_computed_tokens, req.num_prompt_tokens
        used = end % block_size
        if used and start < end <= start + s.num_new_tokens:
            zero_tail(req.block_table[end // block_size], used)


def roundtrip_prompt_blocks(batch, roundtrip: Roundtrip, block_size: int, device: torch.device) -> None:
    """Round-trip the prompt blocks of ``prompt_kv_lossy`` requests that this step's chunks completed.

    A block is complete when all of its prompt slots are computed: a full block the chunk finished,
    or the prompt's last (partial) block when the chunk ends the prompt. Call after the forward pass
    and before the scheduler's commit registers the blocks in the prefix cache.
    """
    blocks: list[int] = []
    for s in batch:
        req, start = s.request, s.request.num_computed_tokens
        if not req.prompt_kv_lossy or start >= req.num_prompt_tokens:
            continue
        end = start + s.num_new_tokens         # the scheduler never runs a chunk past the prompt's end
        last = end // block_size if end % block_size == 0 or end < req.num_prompt_tokens else end // block_size + 1
        blocks.extend(req.block_table[start // block_size:last])
    if blocks:
        roundtrip(torch.tensor(blocks, dtype=torch.long, device=device))
