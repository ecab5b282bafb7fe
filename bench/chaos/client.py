"""One request of the chaos run, as a client sees it: what came back, how it ended, when."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from bench.chaos.workload import ChaosRequest
from proto.pdserve.v1 import generation_pb2 as pb
from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.client import build_request

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


@dataclass(slots=True)
class Outcome:
    """How one request ended. `code` is the gRPC status name, None when the stream ended normally;
    `ended` stays None while the call is open (a request still open at the end of the run hung)."""

    index: int
    started: float
    ended: float | None = None
    first_message_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    code: str | None = None
    details: str = ""
    num_messages: int = 0
    cancelled_by_client: bool = False
    burst: bool = False                     # sent by the admission burst, not by the steady clients


async def run_request(stub: pb_grpc.GenerationServiceStub, req: ChaosRequest, out: Outcome,
                      metadata: tuple = ()) -> Outcome:
    """Send `req`, read its stream into `out` (filled as it goes, so a hung call still shows what it
    had), cancel it where the request says; every call has `req.deadline_s` as its gRPC deadline."""
    request = build_request(token_ids=req.prompt_token_ids, request_id=req.request_id, **req.sampling())
    call = stub.Generate(request, timeout=req.deadline_s, metadata=metadata)

    def cancel() -> None:
        if out.finish_reason is None and not call.done():     # nothing to cancel once it finished
            out.cancelled_by_client = True
            call.cancel()
    timer = None
    if req.cancel_after_s is not None:
        timer = asyncio.get_running_loop().call_later(req.cancel_after_s, cancel)
    try:
        async for msg in call:
            if out.first_message_at is None:
                out.first_message_at = time.monotonic()
            out.num_messages += 1
            out.token_ids.extend(msg.token_ids)
            out.text += msg.text
            if msg.finish_reason:
                out.finish_reason = FINISH.get(msg.finish_reason, str(msg.finish_reason))
            if req.cancel_after_messages is not None and out.num_messages > req.cancel_after_messages:
                cancel()
                if out.cancelled_by_client:
                    break
        if out.cancelled_by_client:
            out.code = "CANCELLED"
        elif out.finish_reason is None:
            out.code, out.details = "NO_FINISH", "the stream ended without a finish reason"
    except grpc.aio.AioRpcError as e:
        out.code, out.details = e.code().name, e.details() or ""
    except asyncio.CancelledError:
        if not out.cancelled_by_client:      # the run itself is being torn down
            raise
        out.code = "CANCELLED"
    finally:
        if timer is not None:
            timer.cancel()
        if not call.done():
            call.cancel()
    out.ended = time.monotonic()
    return out
