"""`deploy.role_change.change_role` over a real engine and its workers (no Ray): work that ends in time is
not handed off, work past the timeout is, with a retryable error the router migrates on; either way the
old worker leaves no request and no KV block, and the new role's worker serves the reference's tokens."""
from __future__ import annotations

import asyncio
import itertools

import pytest

from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from deploy.role_change import change_role
from engine import Engine, EngineArgs, SamplingParams
from kv_transfer import FakeHub, make_receiver
from kv_transfer.settings import layout_of
from worker_support import Collector, decode_job, wait_for

PROMPT = list(range(5, 45))


class Actor:
    """The face `change_role` needs: an id, the engine, the current worker and its role."""

    def __init__(self, engine: Engine):
        self.actor_id, self.engine, self.role = "actor-0", engine, "colocated"
        self.worker = self.make_worker("colocated")
        self.worker.start()

    def make_worker(self, role: str):
        if role == "colocated":
            return ColocatedWorker(self.engine, self.actor_id)
        engine = self.engine
        layout = layout_of(engine.kv_cache, engine.fingerprint, engine.kv_format)
        return DecodeWorker(engine, lambda on_complete: make_receiver(
            "fake", layout, engine.kv_cache, engine.block_manager, codec="none", hub=FakeHub(),
            on_complete=on_complete), self.actor_id)


@pytest.fixture
def actor(tiny_model_dir):
    a = Actor(Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=256)))
    yield a
    a.worker.stop()


_ids = itertools.count()


def submit(actor: Actor, collector: Collector, max_tokens: int) -> str:
    rid = f"r{next(_ids)}"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    actor.worker.submit(decode_job(rid, PROMPT, params), collector.sink(rid))
    return rid


def assert_served_by_the_new_worker(actor: Actor, reference) -> None:
    assert actor.role == "decode" and isinstance(actor.worker, DecodeWorker)
    actor.engine.block_manager.check_no_leaks()
    assert not actor.engine.requests
    collector = Collector()
    rid = submit(actor, collector, 6)
    assert collector.done.wait(30)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert collector.tokens(rid) == reference([PROMPT], [params])[0]


def test_work_that_ends_in_time_is_finished_not_handed_off(actor, reference):
    collector = Collector()
    rid = submit(actor, collector, 8)
    handed_off = asyncio.run(change_role(actor, "decode", 30.0, actor.make_worker))
    assert handed_off == 0
    assert collector.done.is_set() and collector.events[rid][-1].finish_reason
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert collector.tokens(rid) == reference([PROMPT], [params])[0]
    assert_served_by_the_new_worker(actor, reference)


def test_work_past_the_timeout_is_handed_off_with_a_retryable_error(actor, reference):
    collector = Collector()
    rid = submit(actor, collector, 1500)
    assert wait_for(lambda: rid in collector.events)          # decoding: it would take a while to end
    handed_off = asyncio.run(change_role(actor, "decode", 0.0, actor.make_worker))
    assert handed_off == 1
    last = collector.events[rid][-1]
    assert last.error.retryable and not last.finish_reason
    assert 0 < len(collector.tokens(rid)) < 1500
    assert_served_by_the_new_worker(actor, reference)
