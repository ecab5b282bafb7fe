"""Role balance at a fixed actor count (``routing.role_flips: auto``): when to flip one actor between
prefill and decode, with hysteresis (pure; the autoscaler feeds it and runs the flip).

Each tick the autoscaler gives the measured need of each role in actors (the planner's unrounded
``needed_prefill`` / ``needed_decode`` for the observed workload, raised by the in-flight backlog) and
the current split. With N actors in all, the ideal prefill count is N · need_p / (need_p + need_d),
clamped so each role keeps its minimum. Then:

    ideal > current + 0.5 + band   → wants one more prefill actor   (decode → prefill)
    ideal < current − 0.5 − band   → wants one fewer                (prefill → decode)
    otherwise                      → keep (inside the band)

A flip happens only after `flip_after` consecutive ticks want the same one, and never within
`cooldown_ticks` after the last flip: a load that oscillates inside the band, or across it faster
than `flip_after` ticks, flips nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

TO_PREFILL = "decode->prefill"
TO_DECODE = "prefill->decode"


@dataclass(slots=True, frozen=True)
class BalanceSettings:
    band: float = 0.25          # extra distance, in actors, beyond the rounding half before a flip is wanted
    flip_after: int = 2         # consecutive ticks that want the same flip
    cooldown_ticks: int = 3     # ticks after a flip during which no other happens
    min_prefill: int = 1
    min_decode: int = 1


@dataclass(slots=True, frozen=True)
class SplitDecision:
    ideal_prefill: float        # the fractional prefill count the load calls for
    want: int                   # +1 one more prefill actor, -1 one fewer, 0 keep
    flip: str | None            # TO_PREFILL | TO_DECODE | None (this tick)


class RoleBalancer:
    def __init__(self, settings: BalanceSettings | None = None):
        self.settings = settings or BalanceSettings()
        self._streak = 0            # consecutive ticks wanting `_wanted`
        self._wanted = 0
        self._cooldown = 0

    def decide(self, need_prefill: float, need_decode: float, num_prefill: int, num_decode: int) -> SplitDecision:
        """One tick: the flip to make now, if any (the caller makes it, then the split has changed)."""
        s = self.settings
        total = num_prefill + num_decode
        need = max(need_prefill, 0.0) + max(need_decode, 0.0)
        ideal = total * max(need_prefill, 0.0) / need if need > 0 else float(num_prefill)
        ideal = min(max(ideal, float(s.min_prefill)), float(total - s.min_decode))
        want = 1 if ideal > num_prefill + 0.5 + s.band else -1 if ideal < num_prefill - 0.5 - s.band else 0
        cooling = self._cooldown > 0
        self._cooldown = max(self._cooldown - 1, 0)
        self._streak = self._streak + 1 if want and want == self._wanted else (1 if want else 0)
        self._wanted = want
        if not want or self._streak < s.flip_after or cooling:
            return SplitDecision(ideal, want, None)
        self._streak, self._wanted, self._cooldown = 0, 0, s.cooldown_ticks
        return SplitDecision(ideal, want, TO_PREFILL if want > 0 else TO_DECODE)
