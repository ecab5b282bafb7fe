"""The per-layer hook: which blocks' rows a forward pass has made final, layer by layer.

A listener (the prefill worker, to stream KV while prefill runs) sets ``Engine.layer_hook``.
Then every step that computes prompt tokens calls it once per layer, in layer order, right
after that layer wrote its K/V into the paged cache:

    hook(LayerDone(layer=l, blocks=[FinalBlocks(request, start_block, end_block), ...], ready))

``blocks`` lists each sequence of the step that computes prompt tokens (the same list for
every layer of the step): entries ``block_table[start_block:end_block]`` of its table hold
rows that are final for layer ``l`` once this layer ran, and were not before the step
(entries before ``start_block`` were final already: earlier chunks, prefix-cache hits). A
block is final when it holds a full block of prompt tokens, or the prompt's tail once the
whole prompt is computed. ``ready`` is None on CPU (kernels run synchronously: the rows are
written when the hook runs); on an accelerator it is an event recorded on the compute
stream after the layer's kernels: whoever reads the rows on another thread calls
``ready.synchronize()`` there first, never on the compute stream. With no hook set
(colocated and decode engines) the layer loop pays one ``is None`` test per layer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.scheduling.request import Request


@dataclass(frozen=True, slots=True)
class FinalBlocks:
    request: Request
    start_block: int       # first table entry made final this step
    end_block: int         # one past the last final entry (start_block == end_block: none this step)
    prompt_done: bool      # this step computes the prompt's last token (the first token is sampled next)

    @property
    def block_ids(self) -> list[int]:
        return self.request.block_table[self.start_block:self.end_block]


@dataclass(frozen=True, slots=True)
class LayerDone:
    layer: int
    blocks: list[FinalBlocks]
    ready: object | None   # torch.Event (accelerators) with .synchronize(); None on CPU


LayerHook = Callable[[LayerDone], None]


def final_blocks(request: Request, start: int, num_new: int, block_size: int) -> FinalBlocks | None:
    """The blocks a step computing tokens [start, start + num_new) of `request` makes final, or
    None when the step computes no prompt token (a decode)."""
    num_prompt = request.num_prompt_tokens
    if start >= num_prompt:
        return None
    end = min(start + num_new, num_prompt)
    prompt_done = end == num_prompt
    end_block = -(-end // block_size) if prompt_done else end // block_size
    return FinalBlocks(request, min(start // block_size, end_block), end_block, prompt_done)


def layer_written(device: torch.device) -> object | None:
    """What marks a layer's cache writes complete on `device`: None on CPU, else an event recorded
    now on the current (compute) stream."""
    if device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record()
    return event
