"""`PrefillWorker` shipping KV to a `DecodeWorker` over the in-process fake transport (no Ray)."""
from __future__ import annotations

from engine import SamplingParams
from proto.pdserve.v1 import worker_pb2 as wpb
from worker_support import Collector, decode_job, prefill_job, prompts_and_params, wait_blocks_returned, wait_for


def _run(prefill, decode, prompts, params, local=()):
    """Submit every prompt (those in `local` prefilled on the decode worker); wait for every stream."""
    collector = Collector(expected=len(prompts))
    results: dict[str, wpb.PrefillResult] = {}
    for i, (p, prm) in enumerate(zip(prompts, params)):
        rid = f"r{i}"
        if i in local:
            decode.submit(decode_job(rid, p, prm), collector.sink(rid))
            continue
        job = prefill_job(rid, p, prm, decode.endpoint)
        decode.submit(decode_job(rid, p, prm, transfer_id=job.transfer_id), collector.sink(rid))
        prefill.submit(job, lambda r: results.__setitem__(r.request_id, r))
    assert collector.done.wait(30)
    return collector, results


def test_disaggregated_equals_colocated(pair, reference):
    prefill, decode, _ = pair
    prompts, params = prompts_and_params(12, seed=5)
    collector, results = _run(prefill, decode, prompts, params, local={3, 7})
    got = [collector.tokens(f"r{i}") for i in range(12)]
    assert got == reference(prompts, params)
    assert wait_for(lambda: len(results) == 10, 5)
    for i, r in results.items():
        n = int(i[1:])
        assert r.status == wpb.PREFILL_STATUS_SENT and r.first_tokens[0].token_ids[0] == got[n][0]
        assert r.num_prompt_tokens == len(prompts[n]) and r.kv_bytes > 0 and r.wire_bytes > 0
    assert [collector.text(f"r{i}") for i in range(12)] == [decode.engine.tokenizer.decode(g) for g in got]
    wait_blocks_returned(prefill.engine, decode.engine)


def test_corrupted_transfer_reports_a_retryable_failure_and_frees(pair):
    prefill, decode, hub = pair
    hub.tamper = lambda frame: frame[:-3] + b"xyz"
    prompts, params = prompts_and_params(3, seed=6)
    collector, results = _run(prefill, decode, prompts, params)
    for i in range(3):
        last = collector.events[f"r{i}"][-1].error
        assert last.code == 14 and last.retryable and "transfer" in last.message       # UNAVAILABLE
    assert wait_for(lambda: len(results) == 3, 5)
    assert {r.status for r in results.values()} == {wpb.PREFILL_STATUS_FAILED}
    assert all(r.retryable for r in results.values())
    wait_blocks_returned(prefill.engine, decode.engine)


def test_a_bad_request_is_refused_as_not_retryable(pair):
    prefill, decode, _ = pair
    results = []
    vocab = prefill.engine.vocab_size
    prefill.submit(prefill_job("bad", [1, vocab + 5], SamplingParams(max_tokens=2), decode.endpoint), results.append)
    assert wait_for(lambda: results, 5)
    [r] = results
    assert r.status == wpb.PREFILL_STATUS_FAILED and not r.retryable and "outside the vocabulary" in r.error
    wait_blocks_returned(prefill.engine)


def test_request_that_ends_at_its_first_token_ships_nothing(pair, reference):
    prefill, decode, hub = pair
    results = []
    prompt, params = [5, 6, 7, 8], SamplingParams(max_tokens=1, temperature=0.0)
    prefill.submit(prefill_job("one", prompt, params, decode.endpoint), results.append)
    assert wait_for(lambda: results, 10)
    [r] = results
    assert r.status == wpb.PREFILL_STATUS_FINISHED and r.first_tokens[0].finish_reason != 0
    assert list(r.first_tokens[0].token_ids) == reference([prompt], [params])[0]
    wait_blocks_returned(prefill.engine, decode.engine)


def test_first_token_that_completes_a_stop_string_emits_what_the_engine_emits(pair, tiny_model_dir):
    """A first token that completes a stop string gets the colocated engine's text, not the token decoded alone."""
    from engine import Engine, EngineArgs
    prefill, decode, _ = pair
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64))
    tokenizer = engine.tokenizer
    for start in range(3, 200):
        prompt = [start, start + 1, start + 2]
        [first] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids
        stop = tokenizer.decode([first])
        if stop.strip() and "\ufffd" not in stop:
            break
    params = SamplingParams(max_tokens=8, temperature=0.0, stop=(stop,))
    [want] = engine.generate([prompt], params)
    assert want.finish_reason == "stop" and want.text == ""           # the colocated engine emits nothing
    results = []
    prefill.submit(prefill_job("stop", prompt, params, decode.endpoint), results.append)
    assert wait_for(lambda: results, 10)
    [r] = results
    assert r.status == wpb.PREFILL_STATUS_FINISHED and r.first_tokens[0].text == want.text
    wait_blocks_returned(prefill.engine, decode.engine)


def test_abort_before_the_send_reports_aborted(pair):
    prefill, decode, _ = pair
    results = []
    long_prompt = list(range(2, 400))
    prefill.loop.call(lambda: None)
    prefill.submit(prefill_job("gone", long_prompt, SamplingParams(max_tokens=4), decode.endpoint), results.append)
    prefill.abort("gone")
    assert wait_for(lambda: results, 10)
    assert results[0].status in (wpb.PREFILL_STATUS_ABORTED, wpb.PREFILL_STATUS_SENT)
    wait_blocks_returned(prefill.engine)
