"""Token sampling in a fixed order: penalties → temperature → top-k → top-p → seeded draw.

Each draw uses a generator seeded from (request seed, output position), so a
request samples the same tokens alone or batched, before or after preemption,
and on a prefill actor or a decode actor.
"""
from __future__ import annotations

import torch

from engine.request import Request

_MIX = 0x9E3779B97F4A7C15


def draw_seed(seed: int, position: int) -> int:
    return (seed * _MIX + position * 0xBF58476D1CE4E5B9) % (2 ** 63)


def apply_penalties(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """logits: [V] float32. Repetition over prompt + output; frequency/presence over output."""
    p = req.params
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(req.all_token_ids, dtype=torch.long, device=logits.device).unique()
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def top_k_top_p_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] → probabilities after temperature, top-k and top-p masking."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs     # mass strictly before each token
        drop = before >= top_p                              # keeps the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def seeded_draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """Exponential-race draw (argmax p / E), E ~ Exp(1) from a per-position generator."""
    gen = torch.Generator(device=probs.device).manual_seed(draw_seed(seed, position))
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int(torch.argmax(probs / noise))


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits: [N, V] float32, one row per request. Returns one token id per request."""
    greedy_rows = [i for i, r in enumerate(requests) if r.params.greedy and not _has_penalty(r)]
    tokens = [0] * len(requests)
    greedy_set = set(greedy_rows)
    if greedy_rows:
        picked = logits[greedy_rows].argmax(dim=-1).tolist()
        for i, t in zip(greedy_rows, picked):
            tokens[i] = t
    for i, req in enumerate(requests):
        if i in greedy_set:
            continue
        row = apply_penalties(logits[i].clone(), req)
        p = req.params
        if p.greedy:
            tokens[i] = int(row.argmax())
            continue
        probs = top_k_top_p_probs(row, p.temperature, p.top_k, p.top_p)
        tokens[i] = seeded_draw(probs, req.seed, len(req.output_token_ids))
    return tokens


def _has_penalty(req: Request) -> bool:
    p = req.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
