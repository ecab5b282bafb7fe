"""The per-step decision: how many tokens to propose, from measured acceptance and step times.

Verifying k proposals costs the target k more query tokens per sequence. While decode is bound by
reading the weights that is nearly free; at large batches (or on a compute-bound device) it is
not, and rejected proposals are wasted work. Each step the engine is told how long its forward pass
took for how many tokens; a least-squares line over recent steps (decayed) gives
    step_time(tokens) = fixed + per_token * tokens.
With acceptance rate a (accepted / proposed, decayed), a sequence proposing k tokens yields
    E(k) = (1 - a^(k + 1)) / (1 - a)
tokens per step. For B decoding sequences k is the one of 0..num_tokens that maximises
B * E(k) / step_time(B * (1 + k)); k = 0 is decoding without proposals. Until the line is measured
the per-token cost is taken as 0 (bandwidth-bound), so speculation runs and is measured; after
turning down for low acceptance, every `PROBE_EVERY`-th step proposes again to re-measure it.
"""
from __future__ import annotations

DECAY = 0.97              # weight of the past per new step
PROBE_EVERY = 32          # steps between proposals once turned down (keeps the acceptance measured)
PRIOR_ACCEPTANCE = 0.5    # before anything was proposed


class TurnDown:
    def __init__(self, max_tokens: int, adaptive: bool = True):
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.num_proposed = 0.0     # decayed counts
        self.num_accepted = 0.0
        self._sums = [0.0] * 5      # decayed sums of 1, x, y, x^2, x*y (x: tokens of a step, y: seconds)
        self._steps_down = 0

    @property
    def acceptance(self) -> float:
        if self.num_proposed < 1.0:
            return PRIOR_ACCEPTANCE
        return self.num_accepted / self.num_proposed

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A forward pass of `num_tokens` query tokens took `seconds`."""
        x, y = float(num_tokens), seconds
        for i, value in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[i] = self._sums[i] * DECAY + value

    def observe_verified(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed = self.num_proposed * DECAY + num_proposed
        self.num_accepted = self.num_accepted * DECAY + num_accepted

    def step_time(self, num_tokens: int) -> float:
        """Predicted seconds of a step of `num_tokens` tokens (relative values are what matter)."""
        n, sx, sy, sxx, sxy = self._sums
        if n < 1e-9:
            return 1.0
        var = sxx / n - (sx / n) ** 2
        per_token = max((sxy / n - sx * sy / n / n) / var, 0.0) if var > 1e-6 else 0.0
        fixed = max(sy / n - per_token * sx / n, 1e-9)
        return fixed + per_token * num_tokens

    def num_tokens(self, num_seqs: int) -> int:
        """k for this step, with `num_seqs` sequences decoding."""
        if not self.adaptive or num_seqs == 0:
            return self.max_tokens
        a = min(self.acceptance, 0.999)
        best_k, best = 0, num_seqs / self.step_time(num_seqs)
        for k in range(1, self.max_tokens + 1):
            rate = num_seqs * (1 - a ** (k + 1)) / (1 - a) / self.step_time(num_seqs * (1 + k))
            if rate > best * 1.0001:
                best_k, best = k, rate
        if best_k == 0:
            self._steps_down += 1
            if self._steps_down % PROBE_EVERY == 0:
                return 1
        else:
            self._steps_down = 0
        return best_k
