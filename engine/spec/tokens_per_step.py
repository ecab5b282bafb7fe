"""Tokens a speculative step yields per sequence, at an acceptance rate: what the performance model counts.

The model (Leviathan et al., 2023): each proposal is accepted with the same probability α once the ones
before it were, independently. A step that verifies k proposals then yields the accepted run plus the
target's own token:

    E[tokens per step] = 1 + α + α² + … + α^k = (1 − α^(k+1)) / (1 − α)

What the engine counts and reports is the acceptance *ratio* r, accepted / proposed tokens
(`pdserve_spec_acceptance_ratio`, the `bench spec` table, a profile's measurement). At k proposals per
step every step yields 1 + k·r tokens whatever the law; under the model above
r = (α − α^(k+1)) / (k·(1 − α)). `per_token_acceptance` inverts that at the k the ratio was measured
with, so the model reproduces 1 + k·r there and extends it to the other k the turn-down may pick.
"""
from __future__ import annotations


def expected_tokens(alpha: float, num_tokens: int) -> float:
    """Tokens one step yields per sequence with `num_tokens` proposals each accepted with probability `alpha`."""
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0:
        return float(num_tokens + 1)
    return (1.0 - alpha ** (num_tokens + 1)) / (1.0 - alpha)


def acceptance_ratio(alpha: float, num_tokens: int) -> float:
    """Accepted / proposed tokens at `num_tokens` proposals per step and per-token acceptance `alpha`."""
    return (expected_tokens(alpha, num_tokens) - 1.0) / num_tokens


def per_token_acceptance(ratio: float, num_tokens: int) -> float:
    """α whose `acceptance_ratio` at `num_tokens` proposals per step is `ratio` (clamped to [0, 1])."""
    ratio = min(max(ratio, 0.0), 1.0)
    if num_tokens <= 1 or ratio in (0.0, 1.0):
        return ratio
    lo, hi = 0.0, 1.0                     # the ratio rises with α: bisect
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if acceptance_ratio(mid, num_tokens) < ratio else (lo, mid)
    return (lo + hi) / 2
