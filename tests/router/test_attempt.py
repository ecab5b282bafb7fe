"""`EventGate` (router.attempt): held events wait for the PrefillResult, a last finish that outruns it is
deferred with what follows it, and both are released first, in arrival order. `IdleLimit`: each read of a
stream is bounded, not their sum."""
from __future__ import annotations

import asyncio

import pytest

from proto.pdserve.v1 import generation_pb2 as pb, worker_pb2 as wpb
from router.attempt import DecodeLost, EventGate, IdleLimit, chunk_of
from router.backend import Usage
from router.timing import Timing


def events(*token_ids: int) -> list[wpb.DecodeEvent]:
    return [wpb.DecodeEvent(token_ids=[t]) for t in token_ids]


def ids(evs: list[wpb.DecodeEvent]) -> list[int]:
    return [ev.token_ids[0] for ev in evs]


def test_held_events_wait_for_the_prefill_result_and_lead_what_is_read_after_it():
    gate = EventGate(holding=True)
    assert gate.read(events(1, 2)) == [] and gate.read(events(3)) == [] and gate.pending
    assert ids(gate.release()) == [1, 2, 3]
    assert not gate.holding and not gate.pending
    assert ids(gate.read(events(4))) == [4]


def test_deferred_events_wait_until_released_and_nothing_is_deferred_twice():
    gate = EventGate(holding=False)
    batch = events(5, 6, 7)
    assert gate.read(batch) is batch and not gate.pending
    gate.defer(batch[1:])
    assert gate.pending
    assert ids(gate.release()) == [6, 7] and gate.release() == [] and not gate.pending


def test_a_finishing_event_carries_usage_and_timing_only_when_it_is_the_last():
    timing, usage = Timing(), Usage(3, 0, 0)
    ev = wpb.DecodeEvent(token_ids=[9], finish_reason=pb.FINISH_REASON_LENGTH, num_cached_tokens=2)
    chunk = chunk_of(ev, timing, usage, last=False)
    assert (chunk.finish_reason, chunk.usage, chunk.timing) == (pb.FINISH_REASON_LENGTH, None, None)
    chunk = chunk_of(ev, timing, usage, last=True)
    assert chunk.usage is usage and chunk.timing is timing
    assert (usage.completion_tokens, usage.cached_prompt_tokens) == (2, 2)


def test_finishing_events_add_their_speculative_counts_to_the_usage():
    timing, usage = Timing(), Usage(3, 0, 0)
    for index, (proposed, accepted) in enumerate(((12, 7), (4, 1))):        # two sequences
        ev = wpb.DecodeEvent(token_ids=[9], finish_reason=pb.FINISH_REASON_LENGTH, index=index,
                             num_spec_proposed_tokens=proposed, num_spec_accepted_tokens=accepted)
        chunk_of(ev, timing, usage, last=index == 1)
    assert (usage.spec_proposed_tokens, usage.spec_accepted_tokens) == (16, 8)


def test_idle_limit_bounds_each_read_not_their_sum_and_leaves_other_cancels_alone():
    async def main():
        loop = asyncio.get_running_loop()
        limit = IdleLimit(0.2, "decode actor d0")

        async def step() -> str:             # a stream that sends every 50 ms
            await asyncio.sleep(0.05)
            return "events"

        async def hang() -> str:
            await asyncio.Event().wait()
            return "never"
        start = loop.time()
        assert [await limit.read(step) for _ in range(8)] == ["events"] * 8
        assert loop.time() - start >= 0.4                   # twice the limit in all, a quarter of it each
        start = loop.time()
        with pytest.raises(DecodeLost, match="decode actor d0 sent nothing"):
            await limit.read(hang)
        assert loop.time() - start >= 0.2
        reading = asyncio.ensure_future(limit.read(hang))   # a cancel from outside stays a cancel
        await asyncio.sleep(0)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert await limit.read(step) == "events"           # and the limit still serves the next read
        limit.close()
    asyncio.run(main())
