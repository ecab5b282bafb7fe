"""Prompt-lookup proposals: a sequence's own earlier tokens predict its next ones.

The last n tokens of prompt + output are looked up among the earlier tokens, longest n first
(`max_n` down to `min_n`); the tokens after the latest earlier occurrence are the proposal.
Code edits, quotes and summaries repeat spans of their context, and there this is right often.
"""
from __future__ import annotations

import torch


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` tokens to follow `token_ids`, or [] when no earlier n-gram matches."""
    length = len(token_ids)
    if num_tokens <= 0 or length <= min_n:
        return []
    tokens = torch.tensor(token_ids, dtype=torch.long)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows[i] = tokens[i:i + n] for every start before the suffix's own: [length - n, n]
        windows = tokens[:length - 1].unfold(0, n, 1)
        hits = (windows == suffix).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n             # the latest occurrence: the most local context
            return token_ids[start:start + num_tokens]
    return []
