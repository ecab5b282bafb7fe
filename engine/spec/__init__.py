"""Speculative decoding (``speculative:``; docs/speculative.md).

- `config`: the engine's settings (`SpecConfig`).
- `ngram`: prompt-lookup proposals from a sequence's own tokens (`NgramIndex`).
- `draft`: draft-model proposals, with the draft's own paged cache (`DraftModel`).
- `speculator`: proposals before each step, verification counts after it (`Speculator`).
- `verify`: which proposals the target accepts (greedy: its argmax; sampling: the rejection rule).
- `turn_down`: k per step from the decode throughput measured with each k (`TurnDown`).
- `tokens_per_step`: tokens a step yields at an acceptance rate (what the performance model counts).

The rollback of rejected tokens' KV is the scheduler's `settle` (engine/scheduling/scheduler.py).
"""
