"""`ColocatedWorker`: prefills and decodes every request itself, exactly as the engine does."""
from __future__ import annotations

import time

import pytest

from decode_worker.colocated import ColocatedWorker
from engine import Engine, EngineArgs, SamplingParams
from worker_support import Collector, decode_job, prompts_and_params, wait_blocks_returned


@pytest.fixture
def worker(tiny_model_dir):
    w = ColocatedWorker(Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=256)))
    w.start()
    yield w
    w.stop()


def test_colocated_worker_equals_the_engine(worker, reference):
    prompts, params = prompts_and_params(6, seed=11, max_len=200)
    c = Collector(expected=6)
    for i, (p, prm) in enumerate(zip(prompts, params)):
        worker.submit(decode_job(f"c{i}", p, prm), c.sink(f"c{i}"))
    assert c.done.wait(30)
    assert [c.tokens(f"c{i}") for i in range(6)] == reference(prompts, params)
    last = c.events["c0"][-1]
    assert last.finish_reason == 2                           # FINISH_REASON_LENGTH (ignore_eos)
    assert worker.stats()["role"] == "colocated"
    wait_blocks_returned(worker.engine)


def test_a_migrated_request_continues_after_the_tokens_it_already_streamed(worker, reference):
    prompt, params = list(range(5, 70)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [full] = reference([prompt], [params])
    c = Collector()
    worker.submit(decode_job("m", prompt, params, resume=full[:5]), c.sink("m"))
    assert c.done.wait(30)
    assert c.tokens("m") == full[5:]
    wait_blocks_returned(worker.engine)


def test_a_colocated_actor_receives_no_kv(worker):
    c = Collector()
    worker.submit(decode_job("t", [5, 6], SamplingParams(max_tokens=2), transfer_id="t-1"), c.sink("t"))
    assert c.done.wait(5)
    error = c.events["t"][-1].error
    assert error.code == 3 and "receives no KV" in error.message
    assert not worker.engine.requests


def _emitted_after(engine: Engine, prompt, params, k: int) -> str:
    """The text a client has after `k` tokens of an undisturbed run (held-back characters excluded)."""
    rid = engine.add_request(prompt, params)
    text, n = "", 0
    while n < k:
        for out in engine.step():
            text += out.text_delta
            n += len(out.new_token_ids)
    engine.abort(rid)
    return text


def test_migration_keeps_held_back_text_and_finds_a_stop_string_across_the_seam(worker, tiny_model_dir):
    """After a migration the client's text must equal an undisturbed run's, and a
    stop string that straddles the migration point must still end the request."""
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=256))
    tok = engine.tokenizer
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for start in range(5, 200, 7):
        prompt = list(range(start, start + 30))
        [full] = engine.generate([prompt], greedy)
        for k in range(6, 30):
            seam = len(tok.decode(full.token_ids[:k]))
            stop = full.text[seam - 2:seam + 2]
            if len(stop) == 4 and "\ufffd" not in full.text[:seam + 2] and full.text.find(stop) == seam - 2:
                break
        else:
            continue
        break
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))
    [want] = engine.generate([prompt], params)
    assert want.finish_reason == "stop" and want.text == full.text[:seam - 2]
    before = _emitted_after(engine, prompt, params, k)        # what the client has when the actor dies
    assert len(before) < seam                                  # some text was held back for the stop string
    c = Collector()
    worker.submit(decode_job("mig", prompt, params, resume=full.token_ids[:k], resume_text_chars=len(before)),
                  c.sink("mig"))
    assert c.done.wait(30)
    assert c.events["mig"][-1].finish_reason == 1              # FINISH_REASON_STOP
    assert before + c.text("mig") == want.text
    assert full.token_ids[:k] + c.tokens("mig") == want.token_ids
    wait_blocks_returned(worker.engine)


def test_evict_ends_every_open_request_with_a_retryable_error_and_frees_its_blocks(worker):
    c = Collector(expected=2)
    params = SamplingParams(max_tokens=worker.engine.max_model_len - 60, temperature=0.0, ignore_eos=True)
    for rid in ("e0", "e1"):
        worker.submit(decode_job(rid, list(range(5, 60)), params), c.sink(rid))
    end = time.monotonic() + 10
    while not all(c.events.get(rid) for rid in ("e0", "e1")):       # both are decoding
        assert time.monotonic() < end
        time.sleep(0.01)
    evicted = []
    worker.loop.call(lambda: evicted.append(worker.evict("changing role")))
    assert c.done.wait(10)
    assert evicted == [2]
    for rid in ("e0", "e1"):
        error = c.events[rid][-1].error
        assert (error.code, error.retryable) == (14, True) and "changing role" in error.message   # UNAVAILABLE
    wait_blocks_returned(worker.engine)
    assert not worker.engine.requests
