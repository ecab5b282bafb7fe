"""Fake prefill and decode actors behind the router's actor protocol (no Ray, no engine).

Generation is a pure function of the prompt, so a retried or migrated request
must stream exactly the tokens an undisturbed one does:

    token at output position i of sequence j = (sum(prompt) + 7 * i + 13 * j) % 200

(j: which of a request's n sequences; every token's logprob is -(token / 100)).

A prefill actor "ships" its KV by putting (first token, prompt length) into a
shared `KVHub` under the transfer id; the decode actor waits for it there.
Faults are scripted per actor (`faults`: a list consumed one per job).

Each actor's prefix cache is a real `BlockManager` with its `KVEventLog` (`FakeCache`):
a prefill caches its prompt's full blocks (LRU eviction included), a decode stream
caches the prompt it adopts, and `kv_events` answers from the log as an engine does
(`lose`: batch numbers dropped from the answers, as a lossy link would).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.kv_cache.block_manager import BlockManager, prompt_block_hashes
from engine.kv_cache.events import KVEventLog
from proto.pdserve.v1 import generation_pb2, kv_events_pb2 as kpb, worker_pb2 as wpb
from router.actor_protocol import ActorUnavailable
from router.backend import ActorStats
from router.pools import DecodeView, Pools, PrefillView
from router.roles import role_named


def token_at(prompt: list[int], position: int, index: int = 0) -> int:
    return (sum(prompt) + 7 * position + 13 * index) % 200


def logprob_of(token: int) -> generation_pb2.TokenLogprob:
    return generation_pb2.TokenLogprob(token_id=token, logprob=-token / 100)


def num_sequences(params) -> int:
    return params.best_of or params.n or 1


def text_of(token: int) -> str:
    return chr(65 + token % 26)


def expected_tokens(prompt: list[int], max_tokens: int, index: int = 0) -> list[int]:
    return [token_at(prompt, i, index) for i in range(max_tokens)]


@dataclass
class KVHub:
    """Transfers in flight: transfer id -> future of (first token id, prompt length)."""

    transfers: dict[str, asyncio.Future] = field(default_factory=dict)
    streamed: dict[str, asyncio.Event] = field(default_factory=dict)    # the decode side sent its last event
    ended: dict[str, asyncio.Event] = field(default_factory=dict)       # ... and its reader was told the end

    def slot(self, transfer_id: str) -> asyncio.Future:
        if transfer_id not in self.transfers:
            self.transfers[transfer_id] = asyncio.get_running_loop().create_future()
        return self.transfers[transfer_id]

    def stream_done(self, transfer_id: str) -> asyncio.Event:
        return self.streamed.setdefault(transfer_id, asyncio.Event())

    def stream_ended(self, transfer_id: str) -> asyncio.Event:
        """Set when the decode stream's reader is told it ended (its read after the last token)."""
        return self.ended.setdefault(transfer_id, asyncio.Event())


class FakeCache:
    """An engine's prefix cache without the model: a real block manager and its event log."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_manager = BlockManager(num_blocks, block_size)
        self.log = KVEventLog(self.block_manager)

    def compute(self, prompt: list[int]) -> int:
        """Take the prompt's cached prefix, compute (allocate + register) the rest, release it all as an
        engine does when the request ends. Returns the cached tokens (0 and nothing cached when the
        pool is too small)."""
        bm, size = self.block_manager, self.block_manager.block_size
        hashes = prompt_block_hashes(prompt, size)
        hits = bm.match_prefix(hashes[:max(len(prompt) - 1, 0) // size])
        need = -(-len(prompt) // size) - len(hits)
        if need > bm.num_free_blocks - sum(1 for b in hits if bm.blocks[b].ref_count == 0):
            return 0
        bm.touch(hits)
        ids = hits + bm.allocate(need)
        for block_id, block_hash in zip(ids, hashes):
            bm.register(block_id, block_hash)
        bm.free(ids)
        return len(hits) * size


class FakeActor:
    def __init__(self, actor_id: str, role: str, kv_blocks: int = 64, block_size: int = 4):
        self.actor_id, self.role = actor_id, role
        self.cache = FakeCache(kv_blocks, block_size)
        self.lose: set[int] = set()          # batch numbers left out of kv_events answers
        self.alive = True
        self.stats_hang = False               # stats() never answers
        self.faults: list[str] = []          # consumed one per job; "" = behave
        self.aborted: list[str] = []
        self.jobs: list = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def aborted_request(self, request_id: str) -> bool:
        """An abort reached this actor for some attempt of client request `request_id`."""
        return any(a.split("~")[0] == request_id for a in self.aborted)

    async def info(self) -> dict:
        if not self.alive:
            raise ActorUnavailable(f"{self.actor_id} is dead")
        return {"actor_id": self.actor_id}

    async def stats(self) -> ActorStats:
        if self.stats_hang:
            await asyncio.Event().wait()
        if not self.alive:
            raise ActorUnavailable(f"{self.actor_id} is dead")
        return ActorStats(self.actor_id, role_named(self.role), 100, 0, 0, len(self.jobs))

    def next_fault(self) -> str:
        return self.faults.pop(0) if self.faults else ""

    async def kv_events(self, request: kpb.KVEventsRequest) -> kpb.KVEventsResponse:
        if not self.alive:
            raise ActorUnavailable(f"{self.actor_id} is dead")
        response = self.cache.log.answer(request)
        kept = [b for b in response.batches if b.seq not in self.lose]
        del response.batches[:]
        response.batches.extend(kept)
        return response


class FakePrefill(FakeActor):
    """Faults: "unavailable" (the call raises), "sender" / "receiver" (a failed transfer of that
    side), "refuse" (a non-retryable rejection), "hang" (never answers), "late" (the result comes
    after the decode actor has streamed its first tokens), "after_finish" (the result comes only
    once the decode actor has streamed the request's last token), "with_end" (the result comes
    as the decode stream's reader learns it ended: both land in one wake-up of the router)."""

    def __init__(self, actor_id: str, hub: KVHub, kv_blocks: int = 64, block_size: int = 4):
        super().__init__(actor_id, "prefill", kv_blocks, block_size)
        self.hub = hub

    async def prefill(self, job: wpb.PrefillJob) -> wpb.PrefillResult:
        self.jobs.append(job)
        fault = self.next_fault()
        prompt = list(job.prompt_token_ids)
        num_cached_tokens = self.cache.compute(prompt) if fault not in ("unavailable", "hang") else 0
        first_token_id = token_at(prompt, 0)
        firsts = [wpb.DecodeEvent(token_ids=[token_at(prompt, 0, j)], index=j)
                  for j in range(num_sequences(job.params))]
        if job.params.HasField("logprobs"):
            for ev in firsts:
                ev.logprobs.append(logprob_of(ev.token_ids[0]))
        result = wpb.PrefillResult(request_id=job.request_id, transfer_id=job.transfer_id,
                                   num_prompt_tokens=len(prompt), first_tokens=firsts,
                                   prefill_s=0.01, transfer_s=0.002, kv_bytes=1000, wire_bytes=500,
                                   num_cached_tokens=num_cached_tokens)
        if job.params.HasField("prompt_logprobs"):
            result.prompt_logprobs.extend(logprob_of(t) for t in prompt[1:])
        if fault == "unavailable" or not self.alive:
            raise ActorUnavailable(f"{self.actor_id} died")
        if fault == "hang":
            await asyncio.Event().wait()
        if fault == "refuse":
            result.status, result.error, result.retryable = wpb.PREFILL_STATUS_FAILED, "prompt is bad", False
            return result
        if fault in ("sender", "receiver"):
            side = wpb.TRANSFER_SIDE_SENDER if fault == "sender" else wpb.TRANSFER_SIDE_RECEIVER
            result.status, result.error, result.retryable = wpb.PREFILL_STATUS_FAILED, f"{fault} failed", True
            result.failed_side = side
            return result
        if job.params.max_tokens == 1:
            result.status = wpb.PREFILL_STATUS_FINISHED
            for ev in result.first_tokens:
                ev.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                ev.text = text_of(ev.token_ids[0])
            return result
        self.hub.slot(job.transfer_id).set_result((first_token_id, len(prompt)))
        if fault == "late":                  # the result comes after the decode actor has streamed
            await asyncio.sleep(0.05)
        if fault == "with_end":
            await self.hub.stream_ended(job.transfer_id).wait()
        if fault == "after_finish":
            await self.hub.stream_done(job.transfer_id).wait()
            for _ in range(10):              # let the router take in the finish before this reply
                await asyncio.sleep(0)
        result.status = wpb.PREFILL_STATUS_SENT
        return result


class FakeStream:
    def __init__(self, actor: FakeDecode, job: wpb.DecodeJob):
        self.actor, self.job = actor, job
        self.prompt = list(job.prompt_token_ids)
        self.position = len(job.resume_output_ids)
        self.num_sequences = num_sequences(job.params)
        self.done = False
        self.cancelled = False
        self.aborted = False
        self.fault = actor.next_fault()

    async def read(self) -> list[wpb.DecodeEvent] | None:
        if self.done:
            if self.job.transfer_id:
                self.actor.hub.stream_ended(self.job.transfer_id).set()
            return None
        if self.aborted:
            self.done = True
            return [wpb.DecodeEvent(finish_reason=generation_pb2.FINISH_REASON_ABORT)]
        if not self.actor.alive:
            raise ActorUnavailable(f"{self.actor.actor_id} died")
        if self.fault in ("kv_never", "kv_late") and self.job.transfer_id:
            if self.fault == "kv_late":          # the decode worker's wait for the KV to begin runs out
                await asyncio.sleep(self.job.kv_timeout_s)
            self.done = True
            return [wpb.DecodeEvent(error=wpb.DecodeError(code=4, message="KV did not arrive", retryable=True))]
        if self.fault == "invalid":
            self.done = True
            return [wpb.DecodeEvent(error=wpb.DecodeError(code=3, message="bad params"))]
        if self.fault == "hang":
            await asyncio.Event().wait()
        if self.position == 0 and self.job.transfer_id:
            first, num_tokens = await self.actor.hub.slot(self.job.transfer_id)
            assert num_tokens == len(self.prompt) and first == token_at(self.prompt, 0)
        if self.fault.startswith("die_after:") and self.position >= int(self.fault.split(":")[1]):
            self.actor.alive = False
            raise ActorUnavailable(f"{self.actor.actor_id} was killed")
        events = []
        for j in range(self.num_sequences):           # one step: every sequence's next token
            token = token_at(self.prompt, self.position, j)
            event = wpb.DecodeEvent(token_ids=[token], text=text_of(token), index=j)
            if self.job.params.HasField("logprobs"):
                event.logprobs.append(logprob_of(token))
            if self.position == 0 and j == 0 and not self.job.transfer_id and self.job.params.HasField(
                    "prompt_logprobs"):               # prefilled here: the prompt's logprobs lead the stream
                event.prompt_logprobs.extend(logprob_of(t) for t in self.prompt[1:])
            if self.position + 1 >= self.job.params.max_tokens:
                event.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                event.num_spec_proposed_tokens, event.num_spec_accepted_tokens = self.actor.spec_counts
            events.append(event)
        self.position += 1
        self.done = self.position >= self.job.params.max_tokens
        if self.done and self.job.transfer_id:
            self.actor.hub.stream_done(self.job.transfer_id).set()
        await asyncio.sleep(0)
        return events

    def cancel(self) -> None:
        self.cancelled = True
        self.actor.streams.discard(self)


class FakeDecode(FakeActor):
    """Faults: "kv_never" (a retryable error instead of the KV; "kv_late": the same after the job's kv_timeout_s),
    "invalid" (a non-retryable INVALID_ARGUMENT), "die_after:N" (the actor dies after streaming N tokens), "hang"."""

    def __init__(self, actor_id: str, hub: KVHub, kv_blocks: int = 64, block_size: int = 4):
        super().__init__(actor_id, "decode", kv_blocks, block_size)
        self.hub = hub
        self.streams: set[FakeStream] = set()
        self.cached_blocks = 0               # what cached_prefix answers (its prefix cache, scripted)
        self.prefix_queries: list[int] = []  # block hashes asked about, per query
        self.spec_counts = (0, 0)            # speculative tokens proposed, accepted: each sequence's finish reports

    async def cached_prefix(self, query: wpb.PrefixQuery) -> wpb.PrefixHits:
        if not self.alive:
            raise ActorUnavailable(f"{self.actor_id} is dead")
        self.prefix_queries.append(len(query.block_hashes))
        return wpb.PrefixHits(num_cached_blocks=min(self.cached_blocks, len(query.block_hashes)))

    def abort(self, request_id: str) -> None:
        """Like a real actor's: it lands a moment later (a Ray call), and ends that id's stream."""
        super().abort(request_id)

        def land() -> None:
            for stream in self.streams:
                if stream.job.request_id == request_id:
                    stream.aborted = True
        asyncio.get_running_loop().call_later(0.002, land)

    def open_stream(self, job: wpb.DecodeJob) -> FakeStream:
        self.jobs.append(job)
        self.cache.compute(list(job.prompt_token_ids))      # the prompt it adopts (or prefills) stays cached
        stream = FakeStream(self, job)
        self.streams.add(stream)
        return stream


@dataclass
class FakeCluster:
    hub: KVHub
    pools: Pools
    prefill: list[FakePrefill]
    decode: list[FakeDecode]
    long_context: list[FakeDecode]


def fake_cluster(num_prefill: int = 2, num_decode: int = 2, num_long: int = 0, kv_blocks: int = 64,
                 block_size: int = 4) -> FakeCluster:
    hub = KVHub()
    prefill = [FakePrefill(f"prefill-{i}", hub, kv_blocks, block_size) for i in range(num_prefill)]
    decode = [FakeDecode(f"decode-{i}", hub, kv_blocks, block_size) for i in range(num_decode)]
    long_context = [FakeDecode(f"long-{i}", hub, kv_blocks * 4, block_size) for i in range(num_long)]
    pools = Pools([PrefillView(a.actor_id, a, kv_blocks) for a in prefill],
                  [DecodeView(a.actor_id, a, f"kv://{a.actor_id}", kv_blocks) for a in decode],
                  [DecodeView(a.actor_id, a, f"kv://{a.actor_id}", kv_blocks * 4) for a in long_context])
    return FakeCluster(hub, pools, prefill, decode, long_context)
