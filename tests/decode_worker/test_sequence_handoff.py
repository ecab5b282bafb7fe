"""Across the handoff, every sampling and output field gives the same events disaggregated
(prefill worker → fake transport, codec none → decode worker) as on a colocated worker — n sequences
forked over one shipped prompt, logprobs of the first token sampled on the prefill side, prompt
logprobs, stop token ids — and every block comes back on both sides."""
from __future__ import annotations

import threading

import pytest

from decode_worker.colocated import ColocatedWorker
from engine import Engine, EngineArgs, SamplingParams
from proto.pdserve.v1 import worker_pb2 as wpb
from worker_support import decode_job, prefill_job, wait_blocks_returned

PROMPT = list(range(3, 44))          # 41 tokens: two full blocks and a partial one (block size 16)


class Sequences:
    """One request's events, until each of its sequences has finished (or an error came)."""

    def __init__(self, num_sequences: int):
        self.events: list[wpb.DecodeEvent] = []
        self.open = num_sequences
        self.done = threading.Event()

    def emit(self, event: wpb.DecodeEvent) -> None:
        self.events.append(event)
        self.open -= bool(event.finish_reason)
        if self.open == 0 or event.error.code:
            self.done.set()

    def by_index(self) -> dict[int, dict]:
        seqs: dict[int, dict] = {}
        for ev in self.events:
            s = seqs.setdefault(ev.index, {"tokens": [], "text": "", "logprobs": [], "finish": 0, "stop": None})
            s["tokens"] += list(ev.token_ids)
            s["text"] += ev.text
            s["logprobs"] += [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
                              for lp in ev.logprobs]
            if ev.finish_reason:
                s["finish"] = ev.finish_reason
                which = ev.WhichOneof("matched_stop")
                s["stop"] = getattr(ev, which) if which else None
        return seqs


@pytest.fixture
def colocated(tiny_model_dir):
    """Fresh per test, like `pair`: both sides compute the prompt from scratch (no prefix-cache hit on one side
    only, which would change the float32 rounding of the logprobs)."""
    worker = ColocatedWorker(Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=256)))
    worker.start()
    yield worker
    worker.stop()


def _colocated(worker: ColocatedWorker, rid: str, params: SamplingParams) -> Sequences:
    got = Sequences(params.num_sequences)
    worker.submit(decode_job(rid, PROMPT, params), got.emit)
    assert got.done.wait(30)
    return got


def _disaggregated(pair, rid: str, params: SamplingParams) -> tuple[Sequences, wpb.PrefillResult]:
    prefill, decode, _ = pair
    job = prefill_job(rid, PROMPT, params, decode.endpoint)
    got = Sequences(params.num_sequences)
    decode.submit(decode_job(rid, PROMPT, params, transfer_id=job.transfer_id), got.emit)
    results: list[wpb.PrefillResult] = []
    finished = threading.Event()
    prefill.submit(job, lambda r: (results.append(r), finished.set()))
    assert finished.wait(30) and got.done.wait(30)
    return got, results[0]


CASES = {
    "greedy-logprobs": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3),
    "n3-seeded": SamplingParams(max_tokens=7, temperature=0.9, seed=11, n=3, logprobs=2, ignore_eos=True),
    "best-of": SamplingParams(max_tokens=5, temperature=1.0, seed=5, n=1, best_of=3, ignore_eos=True),
    "prompt-logprobs": SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2, ignore_eos=True),
    "penalties-bias": SamplingParams(max_tokens=6, temperature=0.7, seed=3, min_p=0.05, top_k=50,
                                     logit_bias={7: 5.0}, repetition_penalty=1.2, min_tokens=4),
}


@pytest.mark.parametrize("case", CASES)
def test_every_field_matches_the_colocated_worker(pair, colocated, case):
    params = CASES[case]
    want = _colocated(colocated, f"c-{case}", params)
    got, result = _disaggregated(pair, f"d-{case}", params)
    assert result.status == wpb.PREFILL_STATUS_SENT
    assert got.by_index() == want.by_index()
    assert len(got.by_index()) == params.num_sequences
    if params.prompt_logprobs is not None:          # computed by the prefill worker, returned to the router
        colocated_prompt = [ev for ev in want.events if ev.prompt_logprobs][0].prompt_logprobs
        assert list(result.prompt_logprobs) == list(colocated_prompt)
        assert [lp.token_id for lp in result.prompt_logprobs] == PROMPT[1:]
        assert all(len(lp.top) == 2 for lp in result.prompt_logprobs)
    prefill, decode, _ = pair
    wait_blocks_returned(prefill.engine, decode.engine, colocated.engine)


def test_stop_token_ids_end_a_sequence_the_same_way(pair, colocated):
    sampled = dict(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    tokens = _colocated(colocated, "probe", SamplingParams(**sampled)).by_index()[0]["tokens"]
    stop_id = next(t for t in tokens[2:] if t not in tokens[:2])     # first seen at position >= 2
    params = SamplingParams(**sampled, stop_token_ids=(stop_id,))
    want = _colocated(colocated, "c-stop", params).by_index()
    got, _ = _disaggregated(pair, "d-stop", params)
    assert got.by_index() == want
    assert want[0]["tokens"] == tokens[:tokens.index(stop_id) + 1] and want[0]["stop"] == stop_id


def test_sequences_that_all_end_at_the_first_token_need_no_transfer(pair, colocated):
    params = SamplingParams(max_tokens=1, temperature=0.8, seed=2, n=2, logprobs=1)
    want = _colocated(colocated, "c-one", params)
    prefill, decode, _ = pair
    job = prefill_job("d-one", PROMPT, params, decode.endpoint)
    results: list[wpb.PrefillResult] = []
    finished = threading.Event()
    prefill.submit(job, lambda r: (results.append(r), finished.set()))
    assert finished.wait(30)
    [result] = results
    assert result.status == wpb.PREFILL_STATUS_FINISHED and result.wire_bytes == 0
    got = Sequences(2)
    for ev in result.first_tokens:
        got.emit(ev)
    assert got.by_index() == want.by_index()
    wait_blocks_returned(prefill.engine, decode.engine)
