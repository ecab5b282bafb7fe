"""`router.dispatcher.Dispatcher` against fake actors: every admission, retry and migration branch,
without Ray. Each test checks the exact token stream and that no reservation or stream is left."""
from __future__ import annotations

import asyncio
import contextlib
import math
import time

import pytest

from engine.kv_cache.block_manager import blocks_needed
from engine.sampling.params import SamplingParams
from fake_actors import FakeCluster, expected_tokens, fake_cluster, text_of
from proto.pdserve.v1 import generation_pb2 as pb, worker_pb2 as wpb
from router.attempt import chunk_of
from router.backend import BackendError, GenerationInput, Usage
from router.dispatcher import Dispatcher
from router.routing import RoutingSettings
from router.timing import Timing
from waiting import settle, until

BLOCK_SIZE = 4
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


class Counts:
    """A stand-in for router.metrics.Metrics that counts the dispatcher's hooks."""

    def __init__(self):
        self.transfers = self.failed = self.local = self.hit_tokens = 0

    def kv_transfer(self, seconds, kv_bytes, wire_bytes, codec):
        self.transfers += 1

    def transfer_failed(self):
        self.failed += 1

    def local_prefill(self):
        self.local += 1

    def prefix_hit_tokens(self, n):
        self.hit_tokens += n


def make(cluster: FakeCluster, **routing) -> Dispatcher:
    settings = RoutingSettings(**{"max_queue": 8, "stream_idle_s": 2.0, **routing})
    return Dispatcher(cluster.pools, tokenizer=None, max_model_len=1024, block_size=BLOCK_SIZE, routing=settings,
                      metrics=Counts())


def request(rid: str = "r1", max_tokens: int = 6, prompt: list[int] = PROMPT, deadline=None) -> GenerationInput:
    return GenerationInput(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), deadline)


async def collect(dispatcher: Dispatcher, inp: GenerationInput) -> tuple[list[int], list]:
    chunks = [chunk async for chunk in dispatcher.generate(inp)]
    return [t for c in chunks for t in c.token_ids], chunks


def assert_nothing_held(cluster: FakeCluster) -> None:
    for view in (*cluster.pools.decode, *cluster.pools.long_context):
        assert (view.reserved_blocks, view.running) == (0, 0), view.actor_id
    for view in cluster.pools.prefill:
        assert view.queued_tokens == 0, view.actor_id
    for actor in (*cluster.decode, *cluster.long_context):
        assert not actor.streams, f"{actor.actor_id} has open streams"


def run(coro):
    return asyncio.run(coro)


def test_disaggregated_request_streams_the_exact_tokens():
    async def main():
        c = fake_cluster()
        d = make(c)
        tokens, chunks = await collect(d, request(max_tokens=6))
        assert tokens == expected_tokens(PROMPT, 6)
        last = chunks[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(PROMPT), 6)
        assert last.timing.prefill_s == pytest.approx(0.01) and last.timing.kv_transfer_s == pytest.approx(0.002)
        [pjob] = [j for a in c.prefill for j in a.jobs]
        [djob] = [j for a in c.decode for j in a.jobs]
        assert pjob.transfer_id and pjob.transfer_id == djob.transfer_id
        decode_view = next(v for v in c.pools.decode if v.actor_id in {a.actor_id for a in c.decode if a.jobs})
        assert pjob.kv_endpoint == decode_view.endpoint
        assert list(pjob.prompt_token_ids) == PROMPT and pjob.params.max_tokens == 6
        assert d.metrics.transfers == 1 and d.metrics.failed == 0
        assert len(d.recent_finished(math.inf)) == 1
        assert_nothing_held(c)
    run(main())


def test_a_finish_that_outruns_the_prefill_result_waits_for_its_usage_and_timing():
    """The decode stream can end before the PrefillResult's Ray reply lands: the last chunk's usage
    still says the prefill actor's cached tokens, and its timing the prefill and transfer times."""
    async def main():
        c = fake_cluster(num_prefill=1)
        d = make(c)
        await collect(d, request("warm", max_tokens=3))        # the prompt's two full blocks are cached now
        c.prefill[0].faults = ["after_finish"]
        tokens, chunks = await collect(d, request(max_tokens=3))
        assert tokens == expected_tokens(PROMPT, 3)
        last = chunks[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.cached_prompt_tokens == 8
        assert last.timing.prefill_s == pytest.approx(0.01) and last.timing.kv_transfer_s == pytest.approx(0.002)
        assert all(chunk.usage is None for chunk in chunks[:-1])
        assert_nothing_held(c)
    run(main())


def test_a_deferred_finish_survives_the_stream_ending_with_the_prefill_result():
    """The finish waits for the PrefillResult; when that result and the stream's end land in the same
    wake-up, the finish (now queued for delivery) still goes out: no INTERNAL 'ended without a
    finish' (seen once in 48 rag requests of a serving benchmark)."""
    async def main():
        c = fake_cluster(num_prefill=1)
        d = make(c)
        for i in range(5):
            c.prefill[0].faults = ["with_end"]
            tokens, chunks = await collect(d, request(f"r{i}", max_tokens=3))
            assert tokens == expected_tokens(PROMPT, 3) and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert chunks[-1].timing.prefill_s == pytest.approx(0.01)
        assert_nothing_held(c)
    run(main())


def test_short_uncached_prompt_is_prefilled_on_the_decode_actor():
    async def main():
        c = fake_cluster()
        d = make(c, local_prefill_tokens=64)
        tokens, _ = await collect(d, request())
        assert tokens == expected_tokens(PROMPT, 6)
        assert not any(a.jobs for a in c.prefill)
        [djob] = [j for a in c.decode for j in a.jobs]
        assert djob.transfer_id == "" and d.metrics.local == 1
        assert_nothing_held(c)
    run(main())


def test_prefill_is_placed_on_the_actor_with_the_longest_cached_prefix():
    async def main():
        c = fake_cluster()
        d = make(c)
        await collect(d, request("a"))
        first = next(a for a in c.prefill if a.jobs)
        c.pools.prefill[1 - c.prefill.index(first)].queued_tokens = 0
        await collect(d, request("b"))              # same prompt: the actor that computed it
        assert len(first.jobs) == 2
        assert_nothing_held(c)
    run(main())


@pytest.mark.parametrize("fault", ["unavailable", "sender"])
def test_failed_prefill_is_retried_on_another_prefill_actor(fault):
    async def main():
        c = fake_cluster()
        d = make(c)
        c.prefill[0].faults = [fault]
        c.pools.prefill[1].queued_tokens = 1         # prefill-0 is picked first
        tokens, _ = await collect(d, request())
        c.pools.prefill[1].queued_tokens = 0
        assert tokens == expected_tokens(PROMPT, 6)
        assert len(c.prefill[0].jobs) == 1 and len(c.prefill[1].jobs) == 1
        retry = c.prefill[1].jobs[0]
        first = c.prefill[0].jobs[0]
        assert retry.request_id.startswith("r1~") and retry.request_id != first.request_id
        assert first.request_id in c.prefill[0].aborted
        assert sum(len(a.jobs) for a in c.decode) == 2     # same decode actor, a new stream
        assert c.pools.decode[0].healthy and c.pools.decode[1].healthy
        assert_nothing_held(c)
    run(main())


def test_receiver_failure_with_a_dead_decode_actor_moves_the_reservation():
    async def main():
        c = fake_cluster(num_prefill=1)
        d = make(c)
        c.prefill[0].faults = ["receiver"]
        c.pools.decode[1].reserved_blocks = 1      # decode-0 is picked first
        c.decode[0].alive = False                   # ... and does not answer the liveness check
        tokens, _ = await collect(d, request())
        c.pools.decode[1].reserved_blocks = 0
        assert tokens == expected_tokens(PROMPT, 6)
        assert not c.pools.decode[0].healthy
        assert c.prefill[0].jobs[1].kv_endpoint == c.pools.decode[1].endpoint
        assert_nothing_held(c)
    run(main())


def test_receiver_failure_with_a_live_decode_actor_retries_on_another():
    async def main():
        c = fake_cluster(num_prefill=1)
        d = make(c)
        c.prefill[0].faults = ["receiver"]
        c.pools.decode[1].reserved_blocks = 1
        tokens, _ = await collect(d, request())
        c.pools.decode[1].reserved_blocks = 0
        assert tokens == expected_tokens(PROMPT, 6)
        assert len(c.decode[0].jobs) == 1 and len(c.decode[1].jobs) == 1
        assert c.pools.decode[0].healthy and c.pools.decode[0].num_failures == 1
        assert c.pools.decode[1].num_failures == 0
        assert_nothing_held(c)
    run(main())


def test_receiver_failure_on_the_only_decode_actor_retries_there():
    async def main():
        c = fake_cluster(num_prefill=1, num_decode=1)
        d = make(c)
        c.prefill[0].faults = ["receiver"]
        tokens, _ = await collect(d, request())
        assert tokens == expected_tokens(PROMPT, 6) and len(c.decode[0].jobs) == 2
        assert c.pools.decode[0].num_failures == 0          # it served the retry: the count starts over
        assert_nothing_held(c)
    run(main())


def test_a_black_hole_decode_actor_is_quarantined_and_requests_complete_elsewhere():
    """An alive decode actor whose receiver fails everything, though still the 'freest' choice, is
    quarantined: requests complete elsewhere instead of burning every attempt there (UNAVAILABLE)."""
    async def main():
        c = fake_cluster(kv_blocks=64)
        # most_free_blocks: kv_aware would prefer decode-1 once it caches the prompt (it serves the retries)
        d = make(c, max_attempts=3, decode_policy="most_free_blocks")
        c.decode[0].faults = ["kv_never"] * 100              # alive, answers info(), never gets the KV
        c.pools.decode[1].reserved_blocks = 8                # decode-0 is always the freest
        for i in range(10):
            tokens, chunks = await collect(d, request(f"q{i}"))
            assert tokens == expected_tokens(PROMPT, 6) and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(c.decode[0].jobs) == 3                    # then quarantined: skipped while it lasts
        assert c.pools.decode[0].quarantined and c.pools.decode[0].healthy
        c.pools.decode[1].reserved_blocks = 0
        assert_nothing_held(c)
    run(main())


def test_kv_that_never_arrives_is_prefilled_again():
    async def main():
        c = fake_cluster()
        d = make(c)
        c.decode[0].faults = c.decode[1].faults = ["kv_never"]
        tokens, _ = await collect(d, request())
        assert tokens == expected_tokens(PROMPT, 6)
        assert sum(len(a.jobs) for a in c.prefill) == 2
        assert_nothing_held(c)
    run(main())


def test_kv_that_waits_past_the_clients_deadline_ends_the_request_and_blames_no_actor():
    """The decode actor's KV wait is bounded by the client's deadline: when it runs out, the request ends
    DEADLINE_EXCEEDED; it is neither retried nor counted against the actor (no quarantine from short deadlines)."""
    async def main():
        c = fake_cluster()
        d = make(c)
        c.decode[0].faults = c.decode[1].faults = ["kv_late"]
        with pytest.raises(BackendError) as e:
            await collect(d, request(deadline=time.monotonic() + 0.3))
        assert e.value.code == "DEADLINE_EXCEEDED" and "deadline passed" in str(e.value)
        assert sum(len(a.jobs) for a in c.prefill) == 1                  # not prefilled again
        assert all(v.num_failures == 0 for v in c.pools.decode)
        assert_nothing_held(c)
    run(main())


def test_decode_actor_lost_mid_stream_migrates_without_a_gap_or_a_repeat():
    async def main():
        c = fake_cluster()
        d = make(c)
        c.decode[0].faults = ["die_after:3"]         # decode-0 (as free as decode-1) is picked first
        tokens, chunks = await collect(d, request(max_tokens=8))
        assert tokens == expected_tokens(PROMPT, 8)
        assert chunks[-1].usage.completion_tokens == 8
        dead = next(a for a in c.decode if not a.alive)
        survivor = next(a for a in c.decode if a.alive)
        migrated = survivor.jobs[-1]
        assert migrated.transfer_id == ""                       # recomputed locally
        assert list(migrated.resume_output_ids) == expected_tokens(PROMPT, 3)
        assert migrated.resume_text_chars == 3                   # one character per fake token
        assert not migrated.prompt_kv_lossy                      # codec none: the recompute is the KV
        assert not next(v for v in c.pools.decode if v.actor_id == dead.actor_id).healthy
        assert_nothing_held(c)
    run(main())


@pytest.mark.parametrize("local_prefill_tokens, lossy", [(0, True), (10_000, False)])
def test_a_migration_recomputes_the_prompt_through_the_codec_its_stream_began_from(local_prefill_tokens, lossy):
    """fp8: a stream that began from transferred KV resumes through the codec; one prefilled on its
    decode actor (exact KV) resumes exactly."""
    async def main():
        c = fake_cluster()
        settings = RoutingSettings(max_queue=8, stream_idle_s=2.0, local_prefill_tokens=local_prefill_tokens)
        d = Dispatcher(c.pools, tokenizer=None, max_model_len=1024, block_size=BLOCK_SIZE, routing=settings,
                       codec="fp8", metrics=Counts())
        c.decode[0].faults = ["die_after:3"]
        tokens, _ = await collect(d, request(max_tokens=8))
        assert tokens == expected_tokens(PROMPT, 8)
        first, migrated = (next(a for a in c.decode if a.alive is alive).jobs for alive in (False, True))
        assert bool(first[-1].transfer_id) is lossy and not first[-1].prompt_kv_lossy
        assert migrated[-1].transfer_id == "" and migrated[-1].prompt_kv_lossy is lossy
        assert_nothing_held(c)
    run(main())


def _fill(view):
    """(view, blocks held): another request's reservation takes every free block of `view`."""
    held = view.free_blocks
    view.reserved_blocks += held
    view.running += 1
    return view, held


def test_a_migrating_request_waits_for_room_on_another_decode_actor():
    """decode-0 dies mid-stream while decode-1 is full: the request waits at the head of the queue for room
    there, as a new request would, instead of failing because nothing was free at that instant."""
    async def main():
        c = fake_cluster(num_decode=2)
        d = make(c)
        full, held = _fill(c.pools.decode[1])
        c.decode[0].faults = ["die_after:2"]
        streaming = asyncio.create_task(collect(d, request(max_tokens=8)))
        for _ in range(2000):                          # until the migrating request waits for room
            if d.admission._waiters:
                break
            await asyncio.sleep(0.001)
        assert d.admission._waiters and not streaming.done()
        await d.admission.release(full, held)          # that request ends
        tokens, _ = await streaming
        assert tokens == expected_tokens(PROMPT, 8)
        assert c.decode[1].jobs and not c.decode[0].alive
        assert_nothing_held(c)
    run(main())


def test_a_migrating_request_gives_up_when_no_room_comes_in_time():
    async def main():
        c = fake_cluster(num_decode=2)
        d = make(c, max_queue_wait_s=0.2)
        full, held = _fill(c.pools.decode[1])
        c.decode[0].faults = ["die_after:2"]
        with pytest.raises(BackendError) as e:
            await collect(d, request(max_tokens=8))
        assert e.value.code == "UNAVAILABLE" and "none had room in time" in e.value.message
        await d.admission.release(full, held)
        assert_nothing_held(c)
    run(main())


def test_a_migrating_request_no_other_actor_could_ever_hold_fails_at_once():
    """decode-1 holds fewer blocks in all than the request needs: nothing to wait for, so the request fails
    at once instead of heading the admission queue (and holding up every request behind it) for
    max_queue_wait_s."""
    async def main():
        c = fake_cluster(num_decode=2)
        d = make(c, max_queue_wait_s=30.0)
        need = blocks_needed(len(PROMPT), 8, 1, BLOCK_SIZE)
        c.pools.decode[1].kv_blocks_total = need - 1
        c.decode[0].faults = ["die_after:2"]
        with pytest.raises(BackendError) as e:
            await asyncio.wait_for(collect(d, request(max_tokens=8)), 5)
        assert e.value.code == "UNAVAILABLE" and "no other decode actor can take the request" in e.value.message
        assert not d.admission._waiters
        assert_nothing_held(c)
    run(main())


def test_decode_actor_lost_with_no_other_actor_is_unavailable():
    async def main():
        c = fake_cluster(num_decode=1)
        d = make(c)
        c.decode[0].faults = ["die_after:2"]
        got = []
        with pytest.raises(BackendError) as e:
            async for chunk in d.generate(request()):
                got.extend(chunk.token_ids)
        assert e.value.code == "UNAVAILABLE" and "no other decode actor" in e.value.message
        assert got == expected_tokens(PROMPT, 2)
        assert_nothing_held(c)
    run(main())


def test_gives_up_after_max_attempts():
    async def main():
        c = fake_cluster()
        d = make(c, max_attempts=3)
        for a in c.prefill:
            a.faults = ["sender"] * 3
        with pytest.raises(BackendError) as e:
            await collect(d, request())
        assert e.value.code == "UNAVAILABLE" and "3 times" in e.value.message
        assert sum(len(a.jobs) for a in c.prefill) == 3
        assert d.metrics.failed == 3
        assert_nothing_held(c)
    run(main())


def test_a_refused_request_is_invalid_argument_and_not_retried():
    async def main():
        c = fake_cluster()
        d = make(c)
        for a in c.prefill:
            a.faults = ["refuse"]
        with pytest.raises(BackendError) as e:
            await collect(d, request())
        assert e.value.code == "INVALID_ARGUMENT" and "prompt is bad" in e.value.message
        assert sum(len(a.jobs) for a in c.prefill) == 1
        assert_nothing_held(c)
    run(main())


def test_a_decode_side_error_keeps_its_status():
    async def main():
        c = fake_cluster(num_decode=1)
        d = make(c, local_prefill_tokens=64)
        c.decode[0].faults = ["invalid"]
        with pytest.raises(BackendError) as e:
            await collect(d, request())
        assert e.value.code == "INVALID_ARGUMENT" and e.value.message == "bad params"
        assert_nothing_held(c)
    run(main())


def test_request_that_ends_at_its_first_token_needs_no_decode():
    async def main():
        c = fake_cluster()
        d = make(c)
        tokens, chunks = await collect(d, request(max_tokens=1))
        assert tokens == expected_tokens(PROMPT, 1) and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert chunks[-1].text == text_of(tokens[0])            # the prefill actor's text, as it emitted it
        assert chunks[-1].usage.completion_tokens == 1
        decode_actor = next(a for a in c.decode if a.jobs)
        assert decode_actor.aborted_request("r1")       # the waiting decode job is dropped
        assert_nothing_held(c)
    run(main())


def test_client_cancel_aborts_on_both_actors_and_releases_the_reservation():
    async def main():
        c = fake_cluster()
        d = make(c)
        for a in c.decode:
            a.faults = ["hang"]
        gen = d.generate(request())
        task = asyncio.ensure_future(gen.__anext__())
        await until(lambda: sum(v.running for v in c.pools.decode) == 1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await gen.aclose()
        assert any(a.aborted_request("r1") for a in c.decode)
        assert any(a.aborted_request("r1") for a in c.prefill)
        assert_nothing_held(c)
    run(main())


def test_stuck_decode_actor_is_migrated_after_the_idle_timeout():
    async def main():
        c = fake_cluster()
        d = make(c, stream_idle_s=0.2, local_prefill_tokens=64)
        c.decode[0].faults = ["hang"]
        c.pools.decode[1].reserved_blocks = 1
        tokens, _ = await collect(d, request())
        c.pools.decode[1].reserved_blocks = 0
        assert tokens == expected_tokens(PROMPT, 6)
        assert c.decode[1].jobs and not c.pools.decode[0].healthy
        assert_nothing_held(c)
    run(main())


def test_stuck_prefill_actor_is_retried_after_the_idle_timeout():
    async def main():
        c = fake_cluster()
        d = make(c, stream_idle_s=0.2)
        c.prefill[0].faults = ["hang"]
        c.pools.prefill[1].queued_tokens = 1
        tokens, _ = await collect(d, request())
        c.pools.prefill[1].queued_tokens = 0
        assert tokens == expected_tokens(PROMPT, 6)
        assert c.prefill[1].jobs[0].request_id.startswith("r1~")
        assert_nothing_held(c)
    run(main())


def test_admission_refuses_what_no_decode_actor_can_hold():
    async def main():
        c = fake_cluster(kv_blocks=4)
        d = make(c)
        with pytest.raises(BackendError) as e:
            await collect(d, request(max_tokens=20))
        assert e.value.code == "RESOURCE_EXHAUSTED" and "largest decode actor holds 4" in e.value.message
        assert not any(a.jobs for a in (*c.prefill, *c.decode))
    run(main())


def test_admission_waits_for_room_and_refuses_past_its_bound():
    async def main():
        c = fake_cluster(num_decode=1, kv_blocks=8)
        d = make(c, max_queue=1)
        c.pools.decode[0].reserved_blocks = 8               # full
        waiter = asyncio.ensure_future(collect(d, request("w")))
        await until(lambda: d.admission.num_waiting == 1)
        with pytest.raises(BackendError) as e:              # the queue (1) is full: refused at once
            await collect(d, request("x"))
        assert e.value.code == "RESOURCE_EXHAUSTED"
        c.pools.decode[0].reserved_blocks = 0
        await d.admission.notify()
        tokens, _ = await waiter
        assert tokens == expected_tokens(PROMPT, 6)
        assert_nothing_held(c)
    run(main())


def test_long_requests_go_to_the_long_context_pool():
    async def main():
        c = fake_cluster(num_long=1)
        d = make(c, long_request_tokens=12)
        await collect(d, request("short", max_tokens=2))
        await collect(d, request("long", max_tokens=6))
        assert [j.request_id.split("~")[0] for a in c.decode for j in a.jobs] == ["short"]
        assert [j.request_id.split("~")[0] for j in c.long_context[0].jobs] == ["long"]
        assert_nothing_held(c)
    run(main())


def test_stats_skip_actors_that_do_not_answer():
    async def main():
        c = fake_cluster()
        d = make(c)
        c.decode[1].alive = False
        stats = await d.stats()
        assert sorted(s.actor_id for s in stats) == ["decode-0", "prefill-0", "prefill-1"]
        assert await d.ready()
    run(main())


def test_prefill_job_is_a_typed_message():
    async def main():
        c = fake_cluster()
        d = make(c)
        await collect(d, request())
        [job] = [j for a in c.prefill for j in a.jobs]
        assert isinstance(job, wpb.PrefillJob)
        assert wpb.PrefillJob.FromString(job.SerializeToString()) == job
    run(main())


def test_a_late_abort_never_hits_a_request_that_reuses_the_id():
    """Cancel a stream after its first token and resend the same request_id at
    once; the first dispatch's abort lands after the second registered and must not end it."""
    async def main():
        c = fake_cluster(num_decode=1)
        d = make(c, local_prefill_tokens=64)
        gen = d.generate(request("same", max_tokens=8))
        first = await gen.__anext__()
        assert first.token_ids == expected_tokens(PROMPT, 1)
        await gen.aclose()                               # the client cancels
        tokens, chunks = await collect(d, request("same", max_tokens=8))
        assert tokens == expected_tokens(PROMPT, 8) and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        ids = [j.request_id for j in c.decode[0].jobs]
        assert len(set(ids)) == 2 and all(i.startswith("same~") for i in ids)
        await until(lambda: assert_nothing_held(c))      # the late abort lands, then nothing is held
    run(main())


def test_client_ids_with_separators_never_collide_with_attempt_ids():
    async def main():
        c = fake_cluster()
        d = make(c)
        c.prefill[0].faults = ["sender"]
        c.pools.prefill[1].queued_tokens = 1
        await collect(d, request("a"))                   # attempt 2 of "a"
        c.pools.prefill[1].queued_tokens = 0
        await collect(d, request("a#1"))
        await collect(d, request("a~x.1"))
        ids = [j.request_id for a in c.decode for j in a.jobs]
        assert len(ids) == len(set(ids)) == 4
    run(main())


def test_every_request_gets_a_seed_that_survives_migration():
    """An unseeded request gets a server-chosen seed, so a migrated request
    redraws exactly the tokens it would have drawn."""
    async def main():
        c = fake_cluster()
        d = make(c)
        c.decode[0].faults = ["die_after:2"]
        inp = GenerationInput("s", list(PROMPT), SamplingParams(max_tokens=6, temperature=0.8), None)
        assert inp.params.seed is None
        await collect(d, inp)
        jobs = [j for a in c.decode for j in a.jobs] + [j for a in c.prefill for j in a.jobs]
        assert all(j.params.HasField("seed") for j in jobs)
        assert len({j.params.seed for j in jobs}) == 1 and len(jobs) >= 3
    run(main())


def test_cancel_while_migrating_releases_the_reservation_once():
    """A request cancelled while its migration waits for room releases the old decode actor's
    reservation exactly once, not again when it unwinds: the counts never go negative."""
    async def main():
        c = fake_cluster(kv_blocks=16)
        d = make(c)
        c.decode[0].faults = ["die_after:2"]
        full = c.pools.decode[1]
        full.reserved_blocks = full.kv_blocks_total          # nowhere to migrate to: the migration waits
        gen = d.generate(request(deadline=time.monotonic() + 60))
        task = asyncio.ensure_future(collect_gen(gen))
        for _ in range(200):
            if d.admission.num_waiting == 1:
                break
            await asyncio.sleep(0.005)
        assert d.admission.num_waiting == 1                  # migrating: waiting for room
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await gen.aclose()
        dead = c.pools.decode[0]
        assert (dead.reserved_blocks, dead.running) == (0, 0)
        assert (full.reserved_blocks, full.running) == (full.kv_blocks_total, 0)
        full.reserved_blocks = 0
        assert_nothing_held(c)
    run(main())


async def collect_gen(gen) -> list:
    return [chunk async for chunk in gen]


def test_admission_is_first_come_first_served():
    """A newcomer that fits never takes room ahead of an older, larger waiter."""
    async def main():
        c = fake_cluster(num_decode=1, kv_blocks=16)
        d = make(c)
        view = c.pools.decode[0]
        view.reserved_blocks = 16                              # full
        order = []

        async def run_one(rid, max_tokens):
            await collect(d, request(rid, max_tokens=max_tokens))
            order.append(rid)
        big = asyncio.ensure_future(run_one("big", 40))         # (10 + 40) / 4 -> 13 blocks
        while d.admission.num_waiting < 1:
            await asyncio.sleep(0.001)
        small = asyncio.ensure_future(run_one("small", 2))      # 3 blocks
        while d.admission.num_waiting < 2:
            await asyncio.sleep(0.001)
        view.reserved_blocks = 16 - 4                           # room for small, not for big
        await d.admission.notify()
        await settle()                                          # every woken waiter has had its turns
        assert d.admission.num_waiting == 2 and not order       # small does not jump the queue
        view.reserved_blocks = 0
        await d.admission.notify()
        await asyncio.gather(big, small)
        assert [j.request_id.split("~")[0] for j in c.decode[0].jobs] == ["big", "small"]
        assert_nothing_held(c)
    run(main())


def test_admission_wait_is_bounded_without_a_client_deadline():
    async def main():
        c = fake_cluster(num_decode=1, kv_blocks=8)
        d = make(c, max_queue_wait_s=0.1)
        c.pools.decode[0].reserved_blocks = 8
        start = time.monotonic()
        with pytest.raises(BackendError) as e:
            await collect(d, request())
        assert e.value.code == "RESOURCE_EXHAUSTED" and time.monotonic() - start < 2.0
        assert d.admission.num_waiting == 0
    run(main())


def test_admission_bounds_the_prefill_backlog():
    async def main():
        c = fake_cluster(kv_blocks=64)
        d = make(c, max_prefill_backlog_tokens=16, max_queue=1, max_queue_wait_s=5.0)
        for v in c.pools.prefill:
            v.queued_tokens = 12                             # 12 + 10 prompt tokens > 16 on every actor
        waiter = asyncio.ensure_future(collect(d, request("w")))
        while d.admission.num_waiting < 1:
            await asyncio.sleep(0.001)
        with pytest.raises(BackendError) as e:               # the queue (1) is full: refused at once
            await collect(d, request("x"))
        assert e.value.code == "RESOURCE_EXHAUSTED"
        assert not any(a.jobs for a in c.decode)
        c.pools.prefill[0].queued_tokens = 0                 # a backlog drains
        await d.admission.notify()
        tokens, _ = await waiter
        assert tokens == expected_tokens(PROMPT, 6)
        c.pools.prefill[1].queued_tokens = 0
        assert_nothing_held(c)
    run(main())


def test_the_decode_actor_waits_for_the_transfer_to_begin_as_long_as_the_router_waits_for_prefill():
    """Prefill queueing does not eat the transfer deadline: the deadline runs from the send, and the
    decode side waits for the transfer to begin as long as the router waits for the prefill."""
    async def main():
        c = fake_cluster()
        d = make(c, transfer_deadline_s=2.0, stream_idle_s=50.0)
        await collect(d, request())
        [djob] = [j for a in c.decode for j in a.jobs]
        [pjob] = [j for a in c.prefill for j in a.jobs]
        assert pjob.transfer_deadline_s == 2.0 and djob.kv_timeout_s == 50.0
    run(main())


def test_ready_while_some_decode_actor_can_serve():
    async def main():
        c = fake_cluster()
        d = make(c)
        c.pools.decode[0].healthy = False           # restarting: not an outage
        assert await d.ready()
        c.pools.decode[1].draining = True
        assert not await d.ready()
    run(main())


def test_stats_leave_out_an_actor_that_hangs_and_answer_in_bounded_time():
    async def main():
        c = fake_cluster()
        d = make(c)
        c.prefill[0].stats_hang = True
        start = time.monotonic()
        stats = await d.stats(timeout_s=0.2)
        assert time.monotonic() - start < 2.0
        assert sorted(s.actor_id for s in stats) == ["decode-0", "decode-1", "prefill-1"]
    run(main())


# ---- n sequences, logprobs, prompt logprobs, matched stop ------------------------------------------

def _by_index(chunks) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c in chunks:
        out.setdefault(c.index, []).extend(c.token_ids)
    return out


@pytest.mark.parametrize("local", [False, True])
def test_n_sequences_stream_interleaved_and_usage_sums_them(local):
    async def main():
        c = fake_cluster()
        d = make(c, local_prefill_tokens=64 if local else 0)
        inp = request(max_tokens=5)
        inp.params.n, inp.params.logprobs = 3, 1
        _, chunks = await collect(d, inp)
        assert _by_index(chunks) == {j: expected_tokens(PROMPT, 5, j) for j in range(3)}
        finishes = [ch for ch in chunks if ch.finish_reason]
        assert sorted(ch.index for ch in finishes) == [0, 1, 2]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 15
        assert all(ch.usage is None for ch in chunks[:-1])      # only the request's last chunk has usage
        for ch in chunks:                                        # every token scored, logprob beside it
            assert [lp.token_id for lp in ch.logprobs] == ch.token_ids
        [djob] = [j for a in c.decode for j in a.jobs]
        assert djob.params.n == 3
        assert sum(len(a.jobs) for a in c.prefill) == (0 if local else 1)     # one prefill for the three
        assert_nothing_held(c)
    run(main())


def test_n_sequences_reserve_blocks_for_every_sequence():
    from engine.kv_cache.block_manager import blocks_needed

    async def main():
        c = fake_cluster(kv_blocks=64)
        d = make(c)
        inp = request(max_tokens=5)
        inp.params.n = 4
        gen = d.generate(inp)
        await gen.__anext__()
        view = next(v for v in c.pools.decode if v.reserved_blocks)
        assert view.reserved_blocks == blocks_needed(len(PROMPT), 5, 4, BLOCK_SIZE) > blocks_needed(len(PROMPT), 5, 1,
                                                                                                   BLOCK_SIZE)
        await gen.aclose()
        assert_nothing_held(c)
    run(main())


def test_every_sequence_ending_at_its_first_token_needs_no_decode():
    async def main():
        c = fake_cluster()
        d = make(c)
        inp = request(max_tokens=1)
        inp.params.n = 2
        _, chunks = await collect(d, inp)
        assert _by_index(chunks) == {0: expected_tokens(PROMPT, 1, 0), 1: expected_tokens(PROMPT, 1, 1)}
        assert [ch.finish_reason for ch in chunks] == [pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_LENGTH]
        assert chunks[-1].usage.completion_tokens == 2 and chunks[0].usage is None
        assert_nothing_held(c)
    run(main())


@pytest.mark.parametrize("late", [False, True])
def test_prompt_logprobs_from_the_prefill_actor_lead_the_stream(late):
    async def main():
        c = fake_cluster(num_prefill=1)
        d = make(c)
        c.prefill[0].faults = ["late" if late else ""]
        inp = request(max_tokens=4)
        inp.params.prompt_logprobs = 0
        tokens, chunks = await collect(d, inp)
        assert tokens == expected_tokens(PROMPT, 4)
        assert [lp.token_id for lp in chunks[0].prompt_logprobs] == PROMPT[1:]
        assert all(ch.prompt_logprobs is None for ch in chunks[1:])
        assert_nothing_held(c)
    run(main())


def test_prompt_logprobs_of_a_local_prefill_come_from_the_decode_actor():
    async def main():
        c = fake_cluster()
        d = make(c, local_prefill_tokens=64)
        inp = request(max_tokens=3)
        inp.params.prompt_logprobs = 2
        _, chunks = await collect(d, inp)
        assert [lp.token_id for lp in chunks[0].prompt_logprobs] == PROMPT[1:]
        assert_nothing_held(c)
    run(main())


def test_a_request_with_several_sequences_is_not_migrated_after_streaming():
    async def main():
        c = fake_cluster()
        d = make(c)
        c.decode[0].faults = ["die_after:2"]
        inp = request(max_tokens=6)
        inp.params.n = 2
        with pytest.raises(BackendError) as e:
            _ = [chunk async for chunk in d.generate(inp)]
        assert e.value.code == "UNAVAILABLE" and "not migrated" in e.value.message
        assert_nothing_held(c)
    run(main())


def test_matched_stop_reaches_the_chunk():
    from proto.pdserve.v1 import generation_pb2

    for event, want in ((wpb.DecodeEvent(token_ids=[2], stop_token_id=2), 2),
                        (wpb.DecodeEvent(token_ids=[9], stop_str="##"), "##"),
                        (wpb.DecodeEvent(token_ids=[9]), None)):
        event.finish_reason = generation_pb2.FINISH_REASON_STOP
        timing = Timing()
        chunk = chunk_of(event, timing, Usage(3, 0, 0), last=True)
        assert chunk.matched_stop == want and chunk.finish_reason == pb.FINISH_REASON_STOP and chunk.timing is timing


LONG_PROMPT = list(range(5, 5 + 30))       # 30 tokens: 7 full blocks of 4, the last token in block 7


def test_the_decode_actors_cached_prefix_is_pinned_there_and_skipped_by_the_prefill():
    async def main():
        c = fake_cluster(num_decode=1)
        c.decode[0].cached_blocks = 5
        d = make(c)
        tokens, _ = await collect(d, request(prompt=LONG_PROMPT))
        assert tokens == expected_tokens(LONG_PROMPT, 6)
        [pjob] = [j for a in c.prefill for j in a.jobs]
        [djob] = c.decode[0].jobs
        assert c.decode[0].prefix_queries == [7]           # every full block but the last token's
        assert (pjob.skip_blocks, djob.num_cached_blocks) == (5, 5) and djob.transfer_id == pjob.transfer_id
        assert_nothing_held(c)
    run(main())


def test_a_fully_cached_prompt_still_ships_the_block_of_its_last_token():
    async def main():
        prompt = list(range(5, 5 + 32))                    # 8 full blocks: at most 7 may be skipped
        c = fake_cluster(num_decode=1)
        c.decode[0].cached_blocks = 100
        d = make(c)
        await collect(d, request(prompt=prompt))
        [pjob] = [j for a in c.prefill for j in a.jobs]
        assert c.decode[0].prefix_queries == [7] and pjob.skip_blocks == 7
        assert_nothing_held(c)
    run(main())


def test_a_short_remainder_after_the_decode_actors_cached_prefix_is_prefilled_there():
    async def main():
        c = fake_cluster(num_decode=1)
        d = make(c, local_prefill_tokens=12)
        c.decode[0].cached_blocks = 4                      # 30 - 16 = 14 tokens left: remote prefill
        await collect(d, request("a", prompt=LONG_PROMPT))
        assert [j.skip_blocks for a in c.prefill for j in a.jobs] == [4]
        c.decode[0].cached_blocks = 5                      # 30 - 20 = 10 < 12: local, nothing pinned
        tokens, _ = await collect(d, request("b", prompt=LONG_PROMPT))
        assert tokens == expected_tokens(LONG_PROMPT, 6)
        assert len([j for a in c.prefill for j in a.jobs]) == 1
        local = c.decode[0].jobs[-1]
        assert (local.transfer_id, local.num_cached_blocks) == ("", 0) and d.metrics.local == 1
        assert_nothing_held(c)
    run(main())


def test_a_decode_actor_that_does_not_answer_the_prefix_query_gets_the_whole_prompt():
    async def main():
        c = fake_cluster(num_decode=1)
        c.decode[0].cached_blocks = 5

        async def hang(query):
            await asyncio.Event().wait()
        c.decode[0].cached_prefix = hang
        d = make(c)
        started = time.monotonic()
        tokens, _ = await collect(d, request(prompt=LONG_PROMPT))
        assert tokens == expected_tokens(LONG_PROMPT, 6) and time.monotonic() - started < 5
        [pjob] = [j for a in c.prefill for j in a.jobs]
        assert pjob.skip_blocks == 0 and c.decode[0].jobs[0].num_cached_blocks == 0
        assert_nothing_held(c)
    run(main())


def test_decode_prefix_reuse_off_ships_the_whole_prompt_without_asking():
    async def main():
        c = fake_cluster(num_decode=1)
        c.decode[0].cached_blocks = 5
        d = make(c, decode_prefix_reuse=False)
        await collect(d, request(prompt=LONG_PROMPT))
        [pjob] = [j for a in c.prefill for j in a.jobs]
        assert c.decode[0].prefix_queries == [] and pjob.skip_blocks == 0
        assert c.decode[0].jobs[0].num_cached_blocks == 0
        assert_nothing_held(c)
    run(main())
