"""The per-step decision: how many tokens to propose, from measured decode throughput per k.

Verifying k proposals costs the target k more query tokens per sequence, and the engine some work
per proposal. While decode is bound by reading the weights that is nearly free; at large batches,
on a compute-bound device, or with proposals that are rarely right, it loses. What decides is the
measured rate: for each batch-size bucket (powers of two) and each k in 0..num_tokens, the engine
keeps the output tokens and the seconds of its latest `WINDOW` all-decode steps run with that k, so
the rate of k is tokens per step at the acceptance it met × 1 / the step time it took. The window's
slowest step is left out once it holds `TRIES` steps: a one-off stall (the first step of a new shape,
a pause of the host) would otherwise keep a k from ever being chosen again.

A bucket's first `WARMUP` steps decode without proposals and are not measured (the first steps of a
new batch size run slower while the host warms to them, and would favour whichever k ran later);
then it runs every k `TRIES` times, interleaved; then each step takes the k with the best
rate, and now and then a probe step runs the other k measured longest ago, so every k is measured
again and a change in acceptance or load moves the choice. Probes come `PROBE_EVERY` steps apart
while the choice moves; each probe that leaves it where it was doubles the gap, up to
`PROBE_EVERY_MOST`, so a settled bucket spends well under 1 % of its steps on probes.

The acceptance rate (accepted / proposed, decayed) is kept beside it for metrics.
"""
from __future__ import annotations

from collections import deque

WARMUP = 8                # steps of a bucket run with k = 0, unmeasured, before its first measurement
WINDOW = 8                # latest all-decode steps kept per (bucket, k)
TRIES = 3                 # steps of every k before a bucket chooses
PROBE_EVERY = 16          # steps of a bucket between probes (runs of the k measured longest ago)...
PROBE_EVERY_MOST = 256    # ...doubling up to this while the probes leave the choice unchanged


class TurnDown:
    def __init__(self, max_tokens: int, adaptive: bool = True):
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.num_proposed = 0.0     # decayed counts
        self.num_accepted = 0.0
        self.samples: dict[tuple[int, int], deque] = {}    # (bucket, k) -> (output tokens, seconds) per step
        self._measured_at: dict[tuple[int, int], int] = {}  # (bucket, k) -> step count at its latest sample
        self._bucket_steps: dict[int, int] = {}
        self._probing: dict[int, list[int]] = {}           # bucket -> [best k, steps between probes, next probe]
        self._steps = 0
        self._pending: tuple[int, int] | None = None       # (bucket, k) of the step in flight

    @property
    def acceptance(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed >= 1.0 else float("nan")

    def observe_verified(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed = self.num_proposed * 0.97 + num_proposed
        self.num_accepted = self.num_accepted * 0.97 + num_accepted

    def rate(self, bucket: int, k: int) -> float | None:
        """Measured output tokens per second of all-decode steps with k proposals in `bucket`; None if never run."""
        window = self.samples.get((bucket, k))
        if not window:
            return None
        steps = sorted(window, key=lambda s: s[1])
        if len(steps) >= TRIES:
            steps = steps[:-1]                                  # the slowest step left out
        seconds = sum(s for _, s in steps)
        return sum(t for t, _ in steps) / seconds if seconds > 0 else None

    def num_tokens(self, num_seqs: int) -> int:
        """k for this step, with `num_seqs` sequences decoding."""
        self._pending = None
        if not self.adaptive or num_seqs == 0:
            return self.max_tokens
        bucket = num_seqs.bit_length()
        steps = self._bucket_steps[bucket] = self._bucket_steps.get(bucket, 0) + 1
        if steps <= WARMUP:
            return 0
        ks = range(self.max_tokens, -1, -1)
        counts = {k: len(self.samples.get((bucket, k), ())) for k in ks}
        fewest = min(counts.values())
        if fewest < TRIES:
            k = next(k for k in ks if counts[k] == fewest)     # interleaved: max_tokens .. 0, then again
        else:
            best = max(ks, key=lambda k: self.rate(bucket, k) or 0.0)
            probing = self._probing.setdefault(bucket, [best, PROBE_EVERY, steps + PROBE_EVERY])
            if best != probing[0]:                              # the choice moved: probe often again
                probing[:] = [best, PROBE_EVERY, steps + PROBE_EVERY]
            k = best
            if steps >= probing[2]:
                k = min((k for k in ks if k != best), key=lambda k: self._measured_at.get((bucket, k), -1),
                        default=best)
                probing[1] = min(2 * probing[1], PROBE_EVERY_MOST)
                probing[2] = steps + probing[1]
        self._pending = (bucket, k)
        return k

    def observe_step(self, num_output_tokens: int, seconds: float) -> None:
        """The step that asked `num_tokens` decoded only, gave `num_output_tokens` tokens in `seconds`."""
        if self._pending is None:
            return
        self.samples.setdefault(self._pending, deque(maxlen=WINDOW)).append((num_output_tokens, seconds))
        self._steps += 1
        self._measured_at[self._pending] = self._steps
        self._pending = None
