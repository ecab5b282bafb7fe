"""Turns a scheduled batch into one model call and samples the requests that are due a token."""
from __future__ import annotations

import torch

from engine.attention import build_metadata
from engine.model import LlamaModel
from engine.request import Request
from engine.sampler import sample
from engine.scheduler import ScheduledRequest


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, device: torch.device,
                 decode_kernel=None):
        self.model = model
        self.decode_kernel = decode_kernel  # attention_compiled.CompiledDecode, or None for the eager gather
        model.use_input_major_weights()   # faster small-batch decode GEMMs on CPU; a no-op elsewhere
        self.kv_cache = kv_cache          # [L, NB, 2, Hkv, bs, D]
        self.block_size = block_size
        self.device = device

    def run(self, batch: list[ScheduledRequest]) -> tuple[list[Request], list[int]]:
        """Run the model over the batch; return the requests that sampled and their tokens.

        A request samples when this step computes its last pending token (the
        end of its prompt, or the token it generated last step).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        seqs = []
        logit_rows: list[int] = []
        sampling: list[Request] = []
        for s in batch:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            input_ids.extend(req.token_ids(start, start + n))
            positions.extend(range(start, start + n))
            seqs.append((start, n, req.block_table))
            if start + n == req.num_tokens:
                logit_rows.append(len(input_ids) - 1)
                sampling.append(req)
        dev = self.device
        meta = build_metadata(seqs, self.block_size, dev, self.decode_kernel)
        logits = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev),
                            self.kv_cache, meta,
                            torch.tensor(logit_rows, dtype=torch.long, device=dev))
        return sampling, sample(logits, sampling) if sampling else []

    def score(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Logits at every position of one fresh sequence (for exactness checks). [S, V] float32."""
        dev = self.device
        meta = build_metadata([(0, len(token_ids), block_table)], self.block_size, dev)
        return self.model(torch.tensor(token_ids, dtype=torch.long, device=dev),
                          torch.arange(len(token_ids), device=dev), self.kv_cache, meta, None)
