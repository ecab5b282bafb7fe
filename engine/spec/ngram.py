"""Prompt-lookup proposals: a sequence's own earlier tokens predict its next ones.

The last n tokens of prompt + output are looked up among the earlier tokens, longest n first
(`max_n` down to `min_n`); the tokens after the latest earlier occurrence are the proposal.
Code edits, quotes and summaries repeat spans of their context, and there this is right often.

`NgramIndex` keeps, per n, where each n-gram last ended, updated with the tokens a sequence
appends since its last lookup: a lookup costs a few dict reads, whatever the context length.
"""
from __future__ import annotations


class NgramIndex:
    """The n-grams (min_n..max_n) of one sequence's tokens, each mapped to the position it last ended at."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0          # n-grams ending before this position are in `last_end`

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens to follow `token_ids` (which only grow between calls), or []."""
        length = len(token_ids)
        # index every n-gram that ends before the last token (the suffix itself must not match itself)
        for end in range(self.num_indexed, length - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last_end[tuple(token_ids[end - n + 1:end + 1])] = end
        self.num_indexed = max(self.num_indexed, length - 1)
        if num_tokens <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.last_end.get(tuple(token_ids[length - n:]))
            if end is not None:
                return token_ids[end + 1:end + 1 + num_tokens]
        return []


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` tokens to follow `token_ids`, or [] when no earlier n-gram matches."""
    return NgramIndex(min_n, max_n).propose(token_ids, num_tokens)
