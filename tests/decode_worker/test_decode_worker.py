"""`DecodeWorker`: requests wait for their KV as engine requests (WAITING_FOR_KV), fail retryably
when it never comes, and give every block back however they end."""
from __future__ import annotations

from engine import SamplingParams
from engine.scheduling.request import RequestStatus
from worker_support import Collector, decode_job, prefill_job, wait_blocks_returned, wait_for


def test_a_request_waits_for_its_kv_as_an_engine_request(pair):
    _, decode, _ = pair
    c = Collector()
    decode.submit(decode_job("w", [5, 6, 7], SamplingParams(max_tokens=3), transfer_id="t-w"), c.sink("w"))
    assert wait_for(lambda: "w" in decode.engine.requests)
    req = decode.engine.requests["w"]
    assert req.status is RequestStatus.WAITING_FOR_KV and req.kv_transfer_id == "t-w"
    assert decode.stats()["queued_requests"] == 1 and not req.block_table
    decode.abort("w")
    assert c.done.wait(5)
    assert c.events["w"][-1].finish_reason == 3           # FINISH_REASON_ABORT
    assert wait_for(lambda: not decode.engine.requests)


def test_abort_while_waiting_for_kv_and_mid_decode(pair):
    _, decode, _ = pair
    c = Collector(expected=2)
    decode.submit(decode_job("lost", [5, 6, 7], SamplingParams(max_tokens=4), transfer_id="never"), c.sink("lost"))
    decode.submit(decode_job("long", list(range(2, 60)), SamplingParams(max_tokens=1900, ignore_eos=True)),
                  c.sink("long"))
    assert wait_for(lambda: "long" in c.events and len(c.tokens("long")) >= 3)   # decoding, not a fixed sleep
    decode.abort("lost")
    decode.abort("long")
    assert c.done.wait(10)
    assert c.events["lost"][-1].finish_reason == 3 and c.events["long"][-1].finish_reason == 3
    wait_blocks_returned(decode.engine)
    assert not decode._waiting_kv and not decode.streams and not decode.engine.requests


def test_kv_that_never_arrives_times_out_retryably(pair):
    _, decode, _ = pair
    c = Collector()
    decode.submit(decode_job("x", [5, 6], SamplingParams(max_tokens=3), transfer_id="t-x", kv_timeout_s=0.2),
                  c.sink("x"))
    assert c.done.wait(5)
    error = c.events["x"][-1].error
    assert error.code == 4 and error.retryable             # DEADLINE_EXCEEDED
    assert not decode.engine.requests and not decode._waiting_kv


def test_kv_that_arrives_before_its_job_is_adopted(pair, reference):
    prefill, decode, _ = pair
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    job = prefill_job("early", prompt, params, decode.endpoint)
    results = []
    prefill.submit(job, results.append)
    assert wait_for(lambda: results, 10)
    assert wait_for(lambda: job.transfer_id in decode._orphans, 5)           # parked under a lease
    c = Collector()
    decode.submit(decode_job("early", prompt, params, transfer_id=job.transfer_id), c.sink("early"))
    assert c.done.wait(10)
    assert c.tokens("early") == reference([prompt], [params])[0]
    wait_blocks_returned(prefill.engine, decode.engine)


def test_unclaimed_kv_is_freed_after_its_lease(pair):
    prefill, decode, _ = pair
    decode.orphan_lease_s = 0.1
    results = []
    job = prefill_job("nobody", list(range(3, 40)), SamplingParams(max_tokens=5), decode.endpoint)
    prefill.submit(job, results.append)
    assert wait_for(lambda: results, 10)
    wait_blocks_returned(prefill.engine, decode.engine)
    assert not decode._orphans


def test_duplicate_and_bad_jobs_are_refused(pair):
    _, decode, _ = pair
    c = Collector(expected=3)
    decode.submit(decode_job("d", [5, 6], SamplingParams(max_tokens=3), transfer_id="t-d"), c.sink("d"))
    decode.submit(decode_job("d", [5, 6], SamplingParams(max_tokens=3), transfer_id="t-d2"), c.sink("d-dup"))
    decode.submit(decode_job("bad", [5, 6], SamplingParams(max_tokens=0), transfer_id="t-b"), c.sink("bad"))
    assert wait_for(lambda: "d-dup" in c.events and "bad" in c.events, 5)
    assert c.events["d-dup"][-1].error.code == 6            # ALREADY_EXISTS
    bad = c.events["bad"][-1].error
    assert bad.code == 3 and not bad.retryable and "max_tokens" in bad.message    # INVALID_ARGUMENT
    decode.abort("d")
    assert c.done.wait(5)
    assert not decode.engine.requests


def test_an_unexpected_error_while_adopting_frees_the_blocks_and_ends_the_request(pair, reference):
    """Any error while adopting, not only ValueError, ends the request and frees the transfer's blocks
    (and the rest of the poll batch is still adopted)."""
    prefill, decode, _ = pair
    real_adopt = decode.engine.adopt

    def broken(request_id, *args, **kwargs):
        if request_id == "bad":
            raise RuntimeError("simulated bug")
        return real_adopt(request_id, *args, **kwargs)
    decode.engine.adopt = broken
    c = Collector(expected=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = {"bad": list(range(3, 40)), "good": list(range(5, 50))}
    for rid, prompt in prompts.items():
        job = prefill_job(rid, prompt, params, decode.endpoint)
        decode.submit(decode_job(rid, prompt, params, transfer_id=job.transfer_id), c.sink(rid))
        prefill.submit(job, lambda r: None)
    assert c.done.wait(20)
    error = c.events["bad"][-1].error
    assert error.code == 13 and "simulated bug" in error.message          # INTERNAL
    assert c.tokens("good") == reference([prompts["good"]], [params])[0]
    wait_blocks_returned(prefill.engine, decode.engine)
    assert not decode.engine.requests and not decode._waiting_kv


def test_adopted_requests_never_exceed_the_batch_bound(tiny_model_dir, reference):
    """Adopted requests join the running batch only up to max_num_seqs: with max_batch_size 4, at
    most 4 run and the rest queue."""
    from worker_support import worker_pair
    prefill, decode, _ = worker_pair(tiny_model_dir, num_blocks=512, max_num_seqs=4)
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompts = [list(range(3 + i, 30 + i)) for i in range(12)]
        c = Collector(expected=len(prompts))
        for i, prompt in enumerate(prompts):
            job = prefill_job(f"b{i}", prompt, params, decode.endpoint)
            decode.submit(decode_job(f"b{i}", prompt, params, transfer_id=job.transfer_id), c.sink(f"b{i}"))
            prefill.submit(job, lambda r: None)
        seen_running, seen_queued = 0, 0
        while not c.done.is_set():
            stats = decode.stats()
            seen_running = max(seen_running, stats["running_requests"])
            seen_queued = max(seen_queued, stats["queued_requests"])
            c.done.wait(0.002)
        assert seen_running <= 4 and seen_queued > 0
        assert [c.tokens(f"b{i}") for i in range(12)] == reference(prompts, [params] * 12)
        wait_blocks_returned(prefill.engine, decode.engine)
    finally:
        prefill.stop()
        decode.stop()
