"""Per-request latency figures, defined once for every layer that reports them (router, autoscaler, benchmarks)."""
from __future__ import annotations


def time_per_output_token(ttft_s: float, e2e_s: float, num_output_tokens: int) -> float:
    """TPOT: mean time per output token after the first, (E2E − TTFT) / (tokens − 1), as vLLM's
    serving benchmark and DistServe define it; 0.0 for fewer than two tokens (no gap to average).

    `ttft_s` and `e2e_s` share their start, so (last token − first token) / (tokens − 1) is the same figure.
    """
    if num_output_tokens < 2:
        return 0.0
    return (e2e_s - ttft_s) / (num_output_tokens - 1)
