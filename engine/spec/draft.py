"""Draft-model proposals: a much smaller model with the target's tokenizer drafts k tokens.

The draft keeps its own paged KV cache and block manager (no prefix cache); each sequence's
`DraftState` holds its draft block table and how many of its positions the draft has computed.
Before a step, every decoding sequence's draft catches up on the tokens it has not seen (the
whole prompt the first time: on a decode actor this is the local prefill of the draft after the
KV handoff; nothing of the draft crosses the handoff), then drafts k tokens one at a time, all
sequences batched per draft step. Greedy drafts take the argmax; sampled ones draw from q, the
draft's distribution under the request's temperature / top-k / top-p / min-p, with a seed of
their own, and q goes with the proposals to the rejection rule (engine/spec/verify.py).

Rollback needs no bookkeeping: a sequence's draft positions count only up to what the target
computed (`num_computed_tokens`), so rejected proposals are recomputed over; the draft blocks go
back when the sequence ends (`release`), or stay, unused, when the draft pool runs short
(that sequence then proposes nothing until it ends).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import torch

from engine.kv_cache.block_manager import BlockManager
from engine.kv_cache.kv_format import KVFormat
from engine.model.attention import build_metadata
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.sampling.sampler import seeded_draw, top_k_top_p_probs
from engine.scheduling.request import Request

_DRAFT_SALT = 0x6A09E667F3BCC909


@dataclass(slots=True)
class DraftState:
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0            # positions whose draft K/V is in the draft cache


def _tokenizer_digest(model_dir: str) -> str | None:
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class DraftModel:
    def __init__(self, model_dir: str, target_dir: str, target_vocab_size: int, device: torch.device,
                 dtype: torch.dtype, block_size: int, num_blocks: int, max_model_len: int):
        cfg = ModelConfig.from_dir(model_dir)
        if cfg.vocab_size != target_vocab_size:
            raise ValueError(f"speculative.draft.model: {model_dir} has a vocabulary of {cfg.vocab_size} tokens, "
                             f"the served model {target_vocab_size}: a draft must share the tokenizer")
        if _tokenizer_digest(model_dir) != _tokenizer_digest(target_dir):
            raise ValueError(f"speculative.draft.model: {model_dir} has another tokenizer.json than the served "
                             "model: a draft must share the tokenizer")
        self.cfg = cfg
        self.device = device
        self.block_size = block_size
        self.model = load_model(model_dir, cfg, device, dtype, min(max_model_len, cfg.context_limit))
        fmt = KVFormat("auto", cfg.num_hidden_layers, cfg.num_key_value_heads, block_size, cfg.head_dim, dtype)
        self.kv_cache = fmt.allocate(num_blocks, device)    # [L, NB, 2, Hkv, bs, D]
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_cache=False)

    def release(self, req: Request) -> None:
        """Give the sequence's draft blocks back (it ended)."""
        state = req.spec_state
        if isinstance(state, DraftState) and state.block_table:
            self.block_manager.free(state.block_table)
            state.block_table = []
            state.num_computed = 0

    def propose(self, seqs: list[Request], rooms: list[int]) -> None:
        """Set each sequence's `spec_token_ids` (up to its room) and, when it samples, `spec_draft_probs`."""
        active = []
        for req, room in zip(seqs, rooms):
            req.spec_token_ids, req.spec_draft_probs = [], None
            if room <= 0 or req.num_tokens + room - 1 > self.cfg.context_limit:
                continue
            state = req.spec_state if isinstance(req.spec_state, DraftState) else DraftState()
            req.spec_state = state
            state.num_computed = min(state.num_computed, req.num_computed_tokens)   # rollback, preemption
            need = -(-(req.num_tokens + room - 1) // self.block_size) - len(state.block_table)
            if need > 0:
                ids = self.block_manager.allocate(need)
                if ids is None:
                    continue
                state.block_table.extend(ids)
            active.append((req, room, state))
        if not active:
            return
        # the catch-up: every token the draft has not seen, up to the last sampled one
        chunks = [(state.num_computed, req.num_tokens - state.num_computed, state.block_table)
                  for req, _, state in active]
        ids = [t for (req, _, state) in active for t in req.token_ids(state.num_computed, req.num_tokens)]
        logits = self._forward(ids, chunks)
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        for j in range(max(room for _, room, _ in active)):
            going = [i for i, (_, room, _) in enumerate(active) if room > j]
            for row, i in enumerate(going):
                req, _, _ = active[i]
                token, q = self._draw(logits[row], req, req.num_tokens - req.num_prompt_tokens + j)
                req.spec_token_ids.append(token)
                if q is not None:
                    probs[i].append(q)
            feed = [i for i in going if active[i][1] > j + 1]
            if not feed:
                break
            logits = self._forward([active[i][0].spec_token_ids[j] for i in feed],
                                   [(active[i][0].num_tokens + j, 1, active[i][2].block_table) for i in feed])
        for i, (req, room, state) in enumerate(active):
            state.num_computed = req.num_tokens + room - 1
            if probs[i]:
                req.spec_draft_probs = torch.stack(probs[i])           # [room, V]

    def _forward(self, input_ids: list[int], seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """The draft over each sequence's new tokens; logits [len(seqs), V] of each one's last token."""
        dev = self.device
        positions = [p for start, n, _ in seqs for p in range(start, start + n)]
        last, row = [], 0
        for _, n, _ in seqs:
            row += n
            last.append(row - 1)
        meta = build_metadata(seqs, self.block_size, dev, sliding_window=self.cfg.sliding_window)
        return self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                          torch.tensor(positions, dtype=torch.long, device=dev), self.kv_cache, meta,
                          torch.tensor(last, dtype=torch.long, device=dev))

    @staticmethod
    def _draw(logits: torch.Tensor, req: Request, position: int) -> tuple[int, torch.Tensor | None]:
        """The draft token at output `position` and q, the distribution it came from (None: greedy)."""
        p = req.params
        if p.greedy:
            return int(logits.argmax()), None
        q = top_k_top_p_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)
        return seeded_draw(q, req.seed ^ _DRAFT_SALT, position), q
