"""A request's timing: `Timing` (where its time went) and its `Timeline` (the path to its first token).

`Timing` is what the request's last chunk carries: seconds queued, prefilling, moving the KV and
waiting on the decode actor, plus the router's own TTFT and end-to-end figures (pdserve.v1.Timing).
Its `Timeline` splits the TTFT into stages that sum to it (pdserve.v1.Timeline); an actor reports its
own part as `ActorStages` (worker.proto), which `Timeline.add_stages` takes.

Each process times its own stages on its own monotonic clock and reports
durations (clocks differ between processes); the router places them between
its own timestamps. Disaggregated, the path is::

    router   intake → router_queue → dispatch ─┐ (jobs sent)
    prefill  prefill_queue → prefill_compute → sampling → kv_encode → kv_send ─┐ (last chunk handed)
    decode   kv_receive → adopt → first_event ─┐ (on the stream)
    router   first token ◄──────────────────────┘

``transit_s`` is the router's window (jobs sent → first token) less every actor
stage: the router → actor call, the last chunk's wire latency and the stream
back. ``unaccounted_s`` is what is left of the TTFT after every other stage
(the router's own handling between the backend and the client's stream).
Colocated (or prefilled on the decode actor) the same actor reports
prefill_queue → sampling and first_event; the kv_* stages and adopt are 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from proto.pdserve.v1 import generation_pb2 as pb, worker_pb2 as wpb

if TYPE_CHECKING:
    from router.placement.auto import Placement

# (stage, where it is measured, what it holds), in path order: they sum to the TTFT.
STAGES = (
    ("intake_s", "router", "RPC received → backend started (validation, tokenization)"),
    ("router_queue_s", "router", "admission: waiting for decode KV room and prefill backlog"),
    ("dispatch_s", "router", "admitted → jobs sent (pick actors, open the decode stream)"),
    ("prefill_queue_s", "prefill", "job received → first scheduled (thread hop, batch wait)"),
    ("prefill_compute_s", "prefill", "first scheduled → the prompt's last forward pass done"),
    ("sampling_s", "prefill", "forward pass done → first token sampled"),
    ("kv_encode_s", "prefill", "first token → first KV chunk ready (handoff, send thread, encode)"),
    ("kv_send_s", "prefill", "first chunk ready → last chunk handed to the transport"),
    ("kv_receive_s", "decode", "last chunk received → checked, decoded into blocks: done"),
    ("adopt_s", "decode", "transfer done → adopted (loop wake, block tables, first event)"),
    ("first_event_s", "decode", "first token event made → on the stream to the router"),
    ("transit_s", "router", "router window − actor stages: calls, last chunk's wire latency, stream back"),
    ("unaccounted_s", "router", "TTFT − every stage above"),
)
STAGE_NAMES = tuple(name for name, _, _ in STAGES)
# Actor stages: ActorStages field → Timeline field.
ACTOR_STAGES = {"queue_s": "prefill_queue_s", "compute_s": "prefill_compute_s", "sampling_s": "sampling_s",
                "kv_encode_s": "kv_encode_s", "kv_send_s": "kv_send_s", "kv_receive_s": "kv_receive_s",
                "adopt_s": "adopt_s", "first_event_s": "first_event_s"}
CONTEXT = ("kv_chunks", "kv_chunk_s", "kv_send_total_s", "kv_receive_total_s")


@dataclass(slots=True)
class Timeline:
    """Seconds per stage (see STAGES); the context fields overlap the stages and are not summed."""

    intake_s: float = 0.0
    router_queue_s: float = 0.0
    dispatch_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    sampling_s: float = 0.0
    kv_encode_s: float = 0.0
    kv_send_s: float = 0.0
    kv_receive_s: float = 0.0
    adopt_s: float = 0.0
    first_event_s: float = 0.0
    transit_s: float = 0.0
    unaccounted_s: float = 0.0
    kv_chunks: int = 0
    kv_chunk_s: list[float] = field(default_factory=list)
    kv_send_total_s: float = 0.0
    kv_receive_total_s: float = 0.0

    def total(self) -> float:
        """The sum of every stage: the TTFT once `close` ran."""
        return sum(getattr(self, name) for name in STAGE_NAMES)

    def add_stages(self, stages: wpb.ActorStages | None) -> None:
        """Take an actor's stages (the fields it set; the prefill and decode actors set disjoint ones)."""
        if stages is None:
            return
        for src, dst in ACTOR_STAGES.items():
            value = getattr(stages, src)
            if value:
                setattr(self, dst, value)
        if stages.kv_chunks:
            self.kv_chunks = stages.kv_chunks
            self.kv_chunk_s = list(stages.kv_chunk_s)
        self.kv_send_total_s = stages.kv_send_total_s or self.kv_send_total_s
        self.kv_receive_total_s = stages.kv_receive_total_s or self.kv_receive_total_s

    def stages_total(self) -> float:
        """The actors' stages only (the router's window holds them)."""
        return sum(getattr(self, name) for name in ACTOR_STAGES.values())

    def fit_window(self, window_s: float) -> None:
        """The router's window (jobs sent → first token) holds the actor stages and the transit between them."""
        self.transit_s = window_s - self.stages_total()

    def close(self, ttft_s: float) -> None:
        """Whatever the stages leave of `ttft_s` becomes ``unaccounted_s``: they then sum to it."""
        self.unaccounted_s = 0.0
        self.unaccounted_s = ttft_s - self.total()

    def to_proto(self) -> pb.Timeline:
        return pb.Timeline(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_proto(cls, msg: pb.Timeline) -> Timeline:
        return cls(**{f.name: list(getattr(msg, f.name)) if f.name == "kv_chunk_s" else getattr(msg, f.name)
                      for f in fields(cls)})

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class Timing:
    """Where a request's time went, in seconds.

    The router overwrites ``ttft_s`` and ``e2e_s`` with its own measurement
    (from receipt of the RPC), so a backend may leave them at 0.
    """

    queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_queue_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    timeline: Timeline | None = None   # every stage up to the first token
    placement: "Placement | None" = None   # routing.mode auto: where the prompt was prefilled, and why

    def to_proto(self) -> pb.Timing:
        out = pb.Timing(queue_s=self.queue_s, prefill_s=self.prefill_s, kv_transfer_s=self.kv_transfer_s,
                        decode_queue_s=self.decode_queue_s, ttft_s=self.ttft_s, e2e_s=self.e2e_s)
        if self.timeline is not None:
            out.timeline.CopyFrom(self.timeline.to_proto())
        return out
