"""Prefill and decode workers joined by the in-process fake transport (no Ray)."""
from __future__ import annotations

import threading
import time

import pytest

from decode_worker.worker import DecodeJob, DecodeWorker
from engine import Engine, SamplingParams
from kv_transfer import FakeHub, KVLayout, make_receiver, make_sender
from prefill_worker.worker import PrefillJob, PrefillWorker

from cluster_helpers import Collector, prompts_and_params


def _layout(engine: Engine) -> KVLayout:
    c = engine.config
    return KVLayout(c.num_hidden_layers, c.num_key_value_heads, engine.block_size, c.head_dim,
                    engine.dtype, engine.fingerprint)


@pytest.fixture
def pair(tiny_model_dir):
    hub = FakeHub()
    p_engine = Engine(tiny_model_dir, dtype="float32", num_blocks=256)
    d_engine = Engine(tiny_model_dir, dtype="float32", num_blocks=256)
    layout = _layout(p_engine)
    prefill = PrefillWorker(p_engine, make_sender("fake", layout, codec="none", hub=hub))
    decode = DecodeWorker(d_engine, lambda on_complete: make_receiver(
        "fake", layout, d_engine.kv_cache, d_engine.block_manager, codec="none", hub=hub,
        on_complete=on_complete))
    prefill.start()
    decode.start()
    yield prefill, decode, hub
    prefill.stop()
    decode.stop()


def _wait_idle(*engines: Engine, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(e.block_manager.num_used_blocks for e in engines):
        time.sleep(0.02)
    for e in engines:
        e.block_manager.check_no_leaks()


def _run(prefill, decode, prompts, params, local=()):
    collector = Collector()
    collector.expected = len(prompts)
    results = {}
    for i, (p, prm) in enumerate(zip(prompts, params)):
        rid = f"r{i}"
        if i in local:
            decode.submit(DecodeJob(rid, p, prm, transfer_id=None), collector)
            continue
        job = PrefillJob(rid, p, prm, dest=decode.endpoint)
        decode.submit(DecodeJob(rid, p, prm, transfer_id=job.transfer_id), collector)
        prefill.submit(job, lambda r: results.__setitem__(r.request_id, r))
    assert collector.done.wait(30)
    return collector, results


def test_disaggregated_equals_colocated(pair, reference):
    prefill, decode, _ = pair
    prompts, params = prompts_and_params(12, seed=5)
    collector, results = _run(prefill, decode, prompts, params, local={3, 7})
    got = [[t for ev in collector.events[f"r{i}"] for t in ev.token_ids] for i in range(12)]
    assert got == reference(prompts, params)
    assert all(r.status == "sent" and r.first_token_id >= 0 for r in results.values())
    texts = ["".join(ev.text for ev in collector.events[f"r{i}"]) for i in range(12)]
    assert texts == [decode.engine.tokenizer.decode(g) for g in got]
    _wait_idle(prefill.engine, decode.engine)


def test_corrupted_transfer_reports_failure_and_frees(pair):
    prefill, decode, hub = pair
    hub.tamper = lambda frame: frame[:-3] + b"xyz"
    prompts, params = prompts_and_params(3, seed=6)
    collector, results = _run(prefill, decode, prompts, params)
    for i in range(3):
        last = collector.events[f"r{i}"][-1]
        assert last.error_code == "UNAVAILABLE" and "transfer" in last.error
    end = time.monotonic() + 5
    while len(results) < 3 and time.monotonic() < end:
        time.sleep(0.01)
    assert {r.status for r in results.values()} == {"failed"}
    _wait_idle(prefill.engine, decode.engine)


def test_abort_while_waiting_for_kv_and_mid_decode(pair):
    prefill, decode, _ = pair
    events = []
    decode.submit(DecodeJob("lost", [5, 6, 7], SamplingParams(max_tokens=4), transfer_id="never"), events.append)
    decode.submit(DecodeJob("long", list(range(2, 60)), SamplingParams(max_tokens=1900, ignore_eos=True)),
                  events.append)
    time.sleep(0.3)
    decode.abort("lost")
    decode.abort("long")
    end = time.monotonic() + 10
    while time.monotonic() < end and {e.request_id for e in events if e.finish_reason == "abort"} != {"lost", "long"}:
        time.sleep(0.02)
    assert {e.request_id for e in events if e.finish_reason == "abort"} == {"lost", "long"}
    _wait_idle(decode.engine)
    assert not decode._waiting_kv and not decode._running


def test_kv_that_never_arrives_times_out(pair):
    _, decode, _ = pair
    done = threading.Event()
    events = []

    def emit(ev):
        events.append(ev)
        done.set()
    decode.submit(DecodeJob("x", [5, 6], SamplingParams(max_tokens=3), transfer_id="t-x", kv_timeout_s=0.2), emit)
    assert done.wait(5)
    assert events[-1].error_code == "DEADLINE_EXCEEDED"
