"""`EventGate` (router.attempt): held events wait for the PrefillResult, a last finish that outruns it is
deferred with what follows it, and both are released first, in arrival order."""
from __future__ import annotations

from proto.pdserve.v1 import generation_pb2 as pb, worker_pb2 as wpb
from router.attempt import EventGate, chunk_of
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
