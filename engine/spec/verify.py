"""Verification: which of a sequence's proposed tokens the target model accepts.

One step computed the target's logits after the sequence's last token and after each of its k
proposals: row j scores the token that follows proposal j - 1 (row 0: the last sampled token).
Walking the rows in order, a proposal stands while the target would have produced it; the first
one that does not is replaced by the target's own token, and when all k stand, row k gives one
more. So a step yields 1 .. k + 1 tokens.

- Greedy: the target's token is its argmax (after penalties, bias and min_tokens, exactly as
  `sample` computes it), so the output is token for token what decoding without proposals gives.
- Sampling: the standard rejection rule. With p the target's distribution (after the sampler's
  whole order) and q the proposer's, proposal d is accepted with probability min(1, p(d) / q(d));
  a rejected one is replaced by a draw from norm(max(0, p - q)). Then every token is distributed
  as the target's. For n-gram proposals q is a point mass on d: accept with p(d), else draw from p
  without d. Draws are seeded by (sequence seed, output position), so a seeded request gives the
  same tokens for the same proposals, alone or batched.

Row j is judged with the sequence's output extended by the tokens before it, as decoding one
token at a time would see it (penalties, min_tokens and the seeded position all depend on it).
"""
from __future__ import annotations

from collections.abc import Collection

import torch

from engine.sampling.sampler import _shapes_logits, sample, seeded_draw, seeded_uniform, target_probs
from engine.scheduling.request import Request


def accept(logits: torch.Tensor, req: Request, eos_token_ids: Collection[int] = ()) -> list[int]:
    """logits: [1 + k, V] raw rows for `req` and its k `spec_token_ids`. Returns the step's tokens:
    the accepted proposals and then the target's own token (which may be the stopping one)."""
    drafts = req.spec_token_ids
    if req.params.greedy and not _shapes_logits(req):
        # plain greedy: one argmax over every row (nothing shapes later rows either: min_tokens is met)
        picked = logits.argmax(dim=-1).tolist()
        num_accepted = next((j for j, d in enumerate(drafts) if picked[j] != d), len(drafts))
        return picked[:num_accepted + 1]
    tokens: list[int] = []
    output = req.output_token_ids
    try:
        for j in range(len(drafts) + 1):
            draft = drafts[j] if j < len(drafts) else None
            if req.params.greedy:
                token = sample(logits[j:j + 1], [req], eos_token_ids)[0]
            else:
                q = None if req.spec_draft_probs is None or draft is None else req.spec_draft_probs[j]
                token = rejection_sample(target_probs(logits[j], req, eos_token_ids), draft, q, req.seed, len(output))
            tokens.append(token)
            output.append(token)              # the next row sees this token as decoded (undone below)
            if token != draft:
                break
    finally:
        del output[len(output) - len(tokens):]
    return tokens


def rejection_sample(p: torch.Tensor, draft: int | None, q: torch.Tensor | None, seed: int, position: int) -> int:
    """One token at output `position` from the target's distribution p [V], given the proposal `draft`
    drawn from q [V] (None: a point mass on `draft`; `draft` None: no proposal, a plain draw from p)."""
    if draft is None:
        return seeded_draw(p, seed, position)
    q_draft = 1.0 if q is None else float(q[draft])
    if seeded_uniform(seed, position) * q_draft < float(p[draft]):      # u < min(1, p(d) / q(d))
        return draft
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0                  # max(0, p - q) with q the point mass on the draft
    else:
        residual = (p - q).clamp_(min=0.0)
    total = float(residual.sum())
    if total <= 0.0:                           # p == q up to rounding: every proposal is accepted in law
        return draft
    return seeded_draw(residual / total, seed, position)
