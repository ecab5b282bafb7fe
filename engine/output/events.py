"""Engine outputs as the workers' wire events: one `RequestOutput` → one `DecodeEvent` (worker.proto).

A prefill actor ships each sequence's first-token event with the KV (the
`Handoff`) and in its `PrefillResult`; a decode or colocated actor streams one
event per sequence per step. Both build them here, so a field reaches the
router the same way whichever actor produced the token.
"""
from __future__ import annotations

from engine.scheduling.request import RequestOutput
from proto.pdserve.v1 import generation_pb2, worker_pb2 as wpb

FINISH_REASON = {"stop": generation_pb2.FINISH_REASON_STOP, "length": generation_pb2.FINISH_REASON_LENGTH,
                 "abort": generation_pb2.FINISH_REASON_ABORT}


def output_event(out: RequestOutput) -> wpb.DecodeEvent:
    """The event of one step of one sequence: tokens, text delta, logprobs and how it finished."""
    event = wpb.DecodeEvent(token_ids=out.new_token_ids)     # (a streamed token's event: each field set costs)
    if out.text_delta:
        event.text = out.text_delta
    if out.index:
        event.index = out.index
    if out.logprobs:
        event.logprobs.extend(out.logprobs)
    if out.prompt_logprobs:
        event.prompt_logprobs.extend(out.prompt_logprobs)
    if out.finish_reason:
        event.finish_reason = FINISH_REASON[out.finish_reason]
        event.num_cached_tokens = out.num_cached_tokens
        event.num_spec_proposed_tokens = out.num_spec_proposed
        event.num_spec_accepted_tokens = out.num_spec_accepted
        if isinstance(out.matched_stop, str):
            event.stop_str = out.matched_stop
        elif out.matched_stop is not None:
            event.stop_token_id = out.matched_stop
    return event
