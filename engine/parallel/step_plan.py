"""Rank 0's step plan: what every rank of a tensor-parallel group runs next, and how it reaches them.

Rank 0 schedules and samples. For each model call it posts a `StepPlan` (the batch's token ids,
positions, block tables and logit rows, and the cache edits due before it: block copies of forked
sequences, prompt tails to zero) and the other ranks run the same call on their shards. The plan is a flat
int64 array in rank 0's store (no pickle), one key per step; rank 0 deletes a step's key once its model
call is done (every rank has read it by then: the call's all-reduces needed them all). A follower waits
for the next key without a deadline (an idle actor posts nothing) and learns of rank 0's death from its
store connection closing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

IDLE_TIMEOUT = timedelta(days=1)     # a follower waits this long for the next plan (rank 0 may idle)
_STOP = -1


@dataclass(slots=True)
class StepPlan:
    input_ids: list[int]
    positions: list[int]
    seqs: list[tuple[int, int, list[int]]]        # (start, num_new, block_table) per sequence, batch order
    logit_rows: list[int]                         # rows of the batch whose logits rank 0 needs
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # (source, destination) block ids
    zero_tails: list[tuple[int, int]] = field(default_factory=list)     # (block id, first slot to zero)
    stop: bool = False                            # the group is closing: followers return

    def encode(self) -> bytes:
        if self.stop:
            return np.array([_STOP], dtype=np.int64).tobytes()
        head = [len(self.input_ids), len(self.seqs), len(self.logit_rows), len(self.block_copies),
                len(self.zero_tails)]
        body = head + self.input_ids + self.positions + self.logit_rows
        for start, num_new, table in self.seqs:
            body += [start, num_new, len(table), *table]
        for pair in self.block_copies + self.zero_tails:
            body += list(pair)
        return np.array(body, dtype=np.int64).tobytes()

    @classmethod
    def decode(cls, data: bytes) -> StepPlan:
        v = np.frombuffer(data, dtype=np.int64).tolist()
        if v[0] == _STOP:
            return cls([], [], [], [], stop=True)
        num_tokens, num_seqs, num_rows, num_copies, num_zero = v[:5]
        i = 5
        input_ids, positions = v[i:i + num_tokens], v[i + num_tokens:i + 2 * num_tokens]
        i += 2 * num_tokens
        logit_rows = v[i:i + num_rows]
        i += num_rows
        seqs = []
        for _ in range(num_seqs):
            start, num_new, n = v[i:i + 3]
            seqs.append((start, num_new, v[i + 3:i + 3 + n]))
            i += 3 + n
        pairs = [tuple(v[j:j + 2]) for j in range(i, i + 2 * (num_copies + num_zero), 2)]
        return cls(input_ids, positions, seqs, logit_rows, pairs[:num_copies], pairs[num_copies:])


class PlanChannel:
    """Rank 0 `post`s each step's plan; every other rank takes them in order with `next`."""

    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank
        self.step = 0
        if rank:
            store.set_timeout(IDLE_TIMEOUT)     # the group is built: from now on only plans are waited for

    def post(self, plan: StepPlan) -> None:
        self.store.set(f"plan/{self.step}", plan.encode())
        self.step += 1

    def done(self) -> None:
        """Rank 0: the last posted plan ran on every rank (its all-reduces completed); drop its key."""
        self.store.delete_key(f"plan/{self.step - 1}")

    def next(self) -> StepPlan:
        """A follower: the next plan (waits while rank 0 is idle; raises when rank 0 is gone)."""
        plan = StepPlan.decode(self.store.get(f"plan/{self.step}"))
        self.step += 1
        return plan
