"""The per-step decision: how many tokens to propose, from measured decode throughput per k.

Verifying k proposals costs the target k more query tokens per sequence, and the engine some work
per proposal. While decode is bound by reading the weights that is nearly free; at large batches,
on a compute-bound device, or with proposals that are rarely right, it loses. What decides is the
measured rate: for each batch-size bucket (powers of two) and each k in 0..num_tokens, the engine
records the output tokens and the seconds of its all-decode steps run with that k (decayed sums),
so the rate of k is tokens per step at the acceptance it met × 1 / the step time it took. Each step
takes the k with the best rate in its bucket; k = 0 is decoding without proposals. A bucket tries
every k once first, and every `PROBE_EVERY`-th step tries a neighbour of the best (one more, then
one fewer), so a change in acceptance or load moves the choice.

The acceptance rate (accepted / proposed, decayed) is kept beside it for metrics.
"""
from __future__ import annotations

DECAY = 0.9               # weight of the past per new sample of the same (bucket, k)
PROBE_EVERY = 8           # steps between tries of a neighbour of the best k


class TurnDown:
    def __init__(self, max_tokens: int, adaptive: bool = True):
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.num_proposed = 0.0     # decayed counts
        self.num_accepted = 0.0
        self.samples: dict[tuple[int, int], list[float]] = {}   # (bucket, k) -> [output tokens, seconds], decayed
        self._steps = 0
        self._probe_up = True
        self._pending: tuple[int, int] | None = None            # (bucket, k) of the step in flight

    @property
    def acceptance(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed >= 1.0 else float("nan")

    def observe_verified(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed = self.num_proposed * 0.97 + num_proposed
        self.num_accepted = self.num_accepted * 0.97 + num_accepted

    def rate(self, bucket: int, k: int) -> float | None:
        """Measured output tokens per second of all-decode steps with k proposals in `bucket`; None if never run."""
        sample = self.samples.get((bucket, k))
        return None if sample is None or sample[1] <= 0 else sample[0] / sample[1]

    def num_tokens(self, num_seqs: int) -> int:
        """k for this step, with `num_seqs` sequences decoding."""
        self._pending = None
        if not self.adaptive or num_seqs == 0:
            return self.max_tokens
        bucket = num_seqs.bit_length()
        untried = [k for k in range(self.max_tokens, -1, -1) if (bucket, k) not in self.samples]
        if untried:
            k = untried[0]
        else:
            k = max(range(self.max_tokens + 1), key=lambda k: self.rate(bucket, k))
            self._steps += 1
            if self._steps % PROBE_EVERY == 0:
                up = (self._probe_up and k < self.max_tokens) or k == 0
                self._probe_up = not self._probe_up
                k = k + 1 if up else k - 1
        self._pending = (bucket, k)
        return k

    def observe_step(self, num_output_tokens: int, seconds: float) -> None:
        """The step that asked `num_tokens` decoded only, gave `num_output_tokens` tokens in `seconds`."""
        if self._pending is None:
            return
        sample = self.samples.setdefault(self._pending, [0.0, 0.0])
        sample[0] = sample[0] * DECAY + num_output_tokens
        sample[1] = sample[1] * DECAY + seconds
        self._pending = None
