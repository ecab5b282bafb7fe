"""Token sampling in a fixed order: penalties → logit_bias → min_tokens mask → structured-output mask →
temperature → top-k → top-p → min-p → seeded draw. Greedy (temperature 0) is the argmax after penalties,
bias and masks.

The structured-output mask (params.structured, engine/sampling/grammar.py) leaves only the tokens the
sequence's grammar allows next: every constrained row's bitmask in one batched call, applied to those
rows in one tensor op. Where it and the min_tokens mask together leave no token (the grammar is complete
and allows only EOS, which min_tokens bans), the grammar wins: EOS is drawn and, below min_tokens, does
not end the sequence.

Each draw uses a generator seeded from (sequence seed, output position), so a
request samples the same tokens alone or batched, before or after preemption,
and on a prefill actor or a decode actor. Sequence i of a request with n > 1
draws with `child_seed(seed, i)` (sequence 0 with the request's seed).

Logprobs (`token_logprobs`) are the log-softmax of the model's raw float32
logits: before penalties, logit_bias, the masks and temperature, so they say
what the model thinks of a token whatever the sampling settings.
"""
from __future__ import annotations

from collections.abc import Collection

import torch

from engine.sampling.grammar import apply_token_bitmask, fill_bitmask
from engine.scheduling.request import Request
from proto.pdserve.v1 import generation_pb2 as pb

_MIX = 0x9E3779B97F4A7C15
_ACCEPT_SALT = 0x5DEECE66D


def draw_seed(seed: int, position: int) -> int:
    return (seed * _MIX + position * 0xBF58476D1CE4E5B9) % (2 ** 63)


def child_seed(seed: int, index: int) -> int:
    """The seed of sequence `index` of a request seeded `seed`; sequence 0 keeps `seed` itself."""
    if index == 0:
        return seed
    return ((seed ^ 0x2545F4914F6CDD1D) * 0x94D049BB133111EB + index * _MIX) % (2 ** 63)


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


def apply_logit_bias(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """logits: [V]. Adds each token's bias (the OpenAI `logit_bias`)."""
    bias = req.params.logit_bias
    if bias:
        ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
        logits[ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def apply_min_tokens(logits: torch.Tensor, req: Request, eos_token_ids: Collection[int]) -> torch.Tensor:
    """logits: [V]. Below min_tokens output tokens, EOS (unless ignore_eos) and stop_token_ids cannot be drawn."""
    p = req.params
    if len(req.output_token_ids) < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        if banned:
            logits[torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def top_k_top_p_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                      min_p: float = 0.0) -> torch.Tensor:
    """logits: [V] → probabilities after temperature, top-k, top-p and min-p masking."""
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
    if min_p > 0.0:
        # Tokens less likely than min_p x the most likely one (of what top-k / top-p kept) are dropped.
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


def seeded_draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """Exponential-race draw (argmax p / E), E ~ Exp(1) from a per-position generator."""
    gen = torch.Generator(device=probs.device).manual_seed(draw_seed(seed, position))
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int(torch.argmax(probs / noise))


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) of its own for (seed, output position): the speculative acceptance test's."""
    gen = torch.Generator().manual_seed(draw_seed(seed ^ _ACCEPT_SALT, position))
    return float(torch.rand(1, generator=gen))


def target_probs(logits: torch.Tensor, req: Request, eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """logits: [V] raw (not modified) -> the distribution `sample` draws this sequence's next token
    from (temperature > 0): penalties, bias, min_tokens, the grammar's mask (after the sequence's output
    so far), then temperature, top-k/p, min-p."""
    row = logits.clone()
    if _shapes_logits(req):
        apply_min_tokens(apply_logit_bias(apply_penalties(row, req), req), req, eos_token_ids)
    if req.grammar is not None:
        _apply_grammars(logits[None], row[None], [0], [0], [req])
    p = req.params
    return top_k_top_p_probs(row, p.temperature, p.top_k, p.top_p, p.min_p)


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: Collection[int] = ()) -> list[int]:
    """logits: [N, V] float32, one row per sequence (not modified). Returns one token id per sequence."""
    tokens = [0] * len(requests)
    fast = [i for i, r in enumerate(requests) if r.params.greedy and not _shapes_logits(r)]
    if fast:        # the common case: plain greedy rows, one batched argmax
        picked = (logits[fast] if len(fast) < len(requests) else logits).argmax(dim=-1).tolist()
        for i, t in zip(fast, picked):
            tokens[i] = t
        if len(fast) == len(requests):
            return tokens
    fast_set = set(fast)
    slow = [i for i in range(len(requests)) if i not in fast_set]
    rows = logits.clone() if not fast else logits.index_select(0, torch.tensor(slow, device=logits.device))  # [S, V]
    views = rows.unbind(0)              # row j of `rows`, changed in place
    for i, row in zip(slow, views):
        req = requests[i]
        if _shapes_logits(req):
            apply_min_tokens(apply_logit_bias(apply_penalties(row, req), req), req, eos_token_ids)
    constrained = [j for j, i in enumerate(slow) if requests[i].grammar is not None]
    if constrained:
        _apply_grammars(logits, rows, slow, constrained, requests)
    for i, row in zip(slow, views):
        req = requests[i]
        p = req.params
        if p.greedy:
            tokens[i] = int(row.argmax())
            continue
        probs = top_k_top_p_probs(row, p.temperature, p.top_k, p.top_p, p.min_p)
        tokens[i] = seeded_draw(probs, req.seed, len(req.output_token_ids))
    return tokens


def _apply_grammars(logits: torch.Tensor, rows: torch.Tensor, slow: list[int], constrained: list[int],
                    requests: list[Request]) -> None:
    """rows: [S, V] (row j is logits[slow[j]] after penalties, bias and min_tokens); mask rows[constrained]
    by their sequences' grammars: one bitmask for all of them, one op over those rows."""
    seqs = [requests[slow[j]] for j in constrained]
    bitmask = fill_bitmask([s.grammar for s in seqs], [s.output_token_ids for s in seqs])     # [G, W] int32
    bitmask = bitmask.to(rows.device, non_blocking=True)
    if len(constrained) == rows.shape[0]:
        apply_token_bitmask(rows, bitmask)
    else:
        index = torch.tensor(constrained, device=rows.device)
        masked = rows.index_select(0, index)
        apply_token_bitmask(masked, bitmask)
        rows.index_copy_(0, index, masked)
    for k, (j, seq) in enumerate(zip(constrained, seqs)):
        if len(seq.output_token_ids) < seq.params.min_tokens and bool(torch.isneginf(rows[j]).all()):
            row = apply_logit_bias(apply_penalties(logits[slow[j]].clone(), seq), seq)   # no min_tokens ban
            apply_token_bitmask(row[None], bitmask[k:k + 1])
            rows[j] = row


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[pb.TokenLogprob]:
    """logits: [R, V] raw float32 rows; one TokenLogprob per row: `token_ids[r]`'s log-probability and
    the `num_top[r]` most likely tokens, most likely first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    k = max(num_top, default=0)
    if k:
        top_values, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    out = []
    for r, (token, lp) in enumerate(zip(token_ids, chosen)):
        top = [pb.TopLogprob(token_id=t, logprob=v) for t, v in zip(top_ids[r][:num_top[r]],
                                                                     top_values[r][:num_top[r]])] if k else []
        out.append(pb.TokenLogprob(token_id=token, logprob=lp, top=top))
    return out


def _shapes_logits(req: Request) -> bool:
    """Whether anything before temperature changes this sequence's logits this step."""
    p = req.params
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            or bool(p.logit_bias) or len(req.output_token_ids) < p.min_tokens or req.grammar is not None)
