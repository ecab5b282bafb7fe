"""`ColocatedWorker`: prefills and decodes every request itself, exactly as the engine does."""
from __future__ import annotations

import pytest

from decode_worker.colocated import ColocatedWorker
from engine import Engine, SamplingParams
from worker_support import Collector, decode_job, prompts_and_params, wait_blocks_returned


@pytest.fixture
def worker(tiny_model_dir):
    w = ColocatedWorker(Engine(tiny_model_dir, dtype="float32", num_blocks=256))
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
