"""Turns a scheduled batch into one model call; returns the logits of the sequences that are due a token.

The call is described by a `StepPlan` (engine/parallel/step_plan.py): with tensor parallelism rank 0's
runner posts it to the other ranks before running it, and theirs run it as received (`follow`); the cache
edits the engine makes outside the model call (`copy_block`, `zero_tail`) ride in the next plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model import kernel_choice
from engine.model.attention import build_metadata
from engine.model.linear import PACKED_WITH_GEMV, layouts_for
from engine.model.model import LlamaModel
from engine.parallel.step_plan import PlanChannel, StepPlan
from engine.runner.layer_hook import LayerDone, LayerHook, final_blocks, layer_written
from engine.scheduling.request import Request
from engine.scheduling.scheduler import ScheduledRequest


@dataclass(slots=True)
class ModelOutput:
    sampled: list[Request]              # sequences due a token this step, in batch order
    # [R, V] float32, raw: one row per sampled sequence, or 1 + k consecutive rows for one verifying k
    # proposals (`spec_token_ids`): row j scores the token after its j-th proposal.
    logits: torch.Tensor
    # Sequences computing prompt positions whose logprobs they owe: (sequence, first position,
    # logits [num_new_tokens, V] of positions first .. first + num_new_tokens - 1).
    prompt_logits: list[tuple[Request, int, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, device: torch.device,
                 decode_kernel=None, flex_kernel=None, weight_layout: str = "auto", kv_format=None):
        self.model = model
        self.kv_format = kv_format          # engine.kv_cache.kv_format.KVFormat (None: the model dtype)
        self.decode_kernel = decode_kernel  # attention_compiled.CompiledDecode, or None for the eager gather
        self.flex_kernel = flex_kernel      # attention_flex.FlexAttention: all attention through it
        self.graphs = None                  # decode_graphs.DecodeGraphs: pure-decode steps replayed
        if weight_layout == "auto":
            weight_layout = kernel_choice.weight_layout(model)     # measured once per machine (CPU only)
        elif weight_layout not in layouts_for(model.embed_tokens.weight):
            dense = model.embed_tokens.weight          # the dtype and device of every dense projection
            raise ValueError(f"weight_layout {weight_layout!r} is not available for {dense.dtype} "
                             f"on {dense.device.type}; choose one of {', '.join(('auto',) + layouts_for(dense))}")
        model.store_weights(weight_layout)
        if weight_layout == PACKED_WITH_GEMV:
            model.use_dense_rows(kernel_choice.dense_rows(model))    # measured once per machine
        self.kv_cache = kv_cache          # [L, NB, 2, Hkv, bs, D] (quantized: [L, NB, cell_bytes])
        self.block_size = block_size
        self.device = device
        self.sliding_window = model.cfg.sliding_window    # None: full causal attention
        self.layer_hook: LayerHook | None = None          # told as each layer's blocks become final
        self.channel: PlanChannel | None = None           # rank 0 of a tensor-parallel group: plans go out here
        self._copies: list[tuple[int, int]] = []          # cache edits the other ranks have not made yet
        self._zero_tails: list[tuple[int, int]] = []

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block of the cache (every layer, K and V) — on every rank of the group."""
        self.kv_cache[:, destination].copy_(self.kv_cache[:, source])
        if self.channel is not None:
            self._copies.append((source, destination))

    def zero_tail(self, block: int, first_slot: int) -> None:
        """Zero the slots of a block from `first_slot` on (every layer, K and V) — on every rank of the group."""
        self.kv_cache[:, block, :, :, first_slot:, :] = 0
        if self.channel is not None:
            self._zero_tails.append((block, first_slot))

    def run(self, batch: list[ScheduledRequest]) -> ModelOutput:
        """Run the model over the batch; return the logits of the sequences that sample.

        A sequence samples when this step computes its last pending token (the
        end of its prompt, or the token it generated last step). A sequence that owes
        prompt logprobs also gets the logits of every prompt position of its chunk.
        A sequence with proposals computes them after its last token and gets every one's logits.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        seqs = []
        logit_rows: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        prompt_parts: list[tuple[Request, int, int, int]] = []    # (sequence, first position, first row, rows)
        for s in batch:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            num_spec = len(req.spec_token_ids)
            input_ids.extend(req.token_ids(start, start + n - num_spec) + req.spec_token_ids)
            positions.extend(range(start, start + n))
            seqs.append((start, n, req.block_table))
            due = start + n == req.num_tokens + num_spec
            if req.params.prompt_logprobs is not None and req.owes_prompt_logprobs:
                prompt_parts.append((req, start, len(logit_rows), n))
                logit_rows.extend(range(len(input_ids) - n, len(input_ids)))
            elif due:
                logit_rows.extend(range(len(input_ids) - 1 - num_spec, len(input_ids)))
            if due:
                sample_rows.extend(range(len(logit_rows) - 1 - num_spec, len(logit_rows)))
                sampling.append(req)
        if self.graphs is not None and not prompt_parts and self.graphs.accepts(seqs):
            return ModelOutput(sampling, self.graphs.run(input_ids, positions, seqs))
        plan = StepPlan(input_ids, positions, seqs, logit_rows, self._copies, self._zero_tails)
        if self.channel is not None:
            self._copies, self._zero_tails = [], []
            self.channel.post(plan)
        logits = self.execute(plan, self._layer_hook(batch) if self.layer_hook is not None else None)
        if self.channel is not None:
            self.channel.done()
        if not prompt_parts:
            return ModelOutput(sampling, logits)
        prompt_logits = [(req, start, logits[row:row + n]) for req, start, row, n in prompt_parts]
        return ModelOutput(sampling, logits[sample_rows], prompt_logits)

    def execute(self, plan: StepPlan, layer_hook=None) -> torch.Tensor | None:
        """One model call as `plan` describes it; the logits of its rows (None on a rank other than 0)."""
        dev = self.device
        meta = build_metadata(plan.seqs, self.block_size, dev, self.decode_kernel, self.sliding_window,
                              self.flex_kernel, self.kv_format)
        return self.model(torch.tensor(plan.input_ids, dtype=torch.long, device=dev),
                          torch.tensor(plan.positions, dtype=torch.long, device=dev),
                          self.kv_cache, meta, torch.tensor(plan.logit_rows, dtype=torch.long, device=dev),
                          layer_hook)

    def follow(self, channel: PlanChannel) -> None:
        """A rank other than 0: run rank 0's plans, in order, until it closes the group."""
        while not (plan := channel.next()).stop:
            for source, destination in plan.block_copies:
                self.kv_cache[:, destination].copy_(self.kv_cache[:, source])
            for block, first_slot in plan.zero_tails:
                self.kv_cache[:, block, :, :, first_slot:, :] = 0
            self.execute(plan)

    def _layer_hook(self, batch: list[ScheduledRequest]):
        """The model's per-layer callback for this batch: None when no sequence computes prompt tokens."""
        blocks = [f for s in batch
                  if (f := final_blocks(s.request, s.request.num_computed_tokens, s.num_new_tokens,
                                        self.block_size)) is not None]
        if not blocks:
            return None
        hook, device = self.layer_hook, self.device

        def layer_done(layer: int) -> None:
            hook(LayerDone(layer, blocks, layer_written(device)))
        return layer_done

    def score(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Logits at every position of one fresh sequence (for exactness checks). [S, V] float32."""
        n = len(token_ids)
        plan = StepPlan(list(token_ids), list(range(n)), [(0, n, list(block_table))], list(range(n)))
        if self.channel is not None:
            self.channel.post(plan)
        logits = self.execute(plan)
        if self.channel is not None:
            self.channel.done()
        return logits
