"""Speculative decoding on a decode actor: after the KV handoff (over each transport) and after a
migration (prompt + emitted tokens recomputed there), the streamed tokens equal the colocated
engine's without speculation; each sequence's last event carries its proposed / accepted counts."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.spec.config import SpecConfig
from worker_support import Collector, decode_job, prefill_job, wait_blocks_returned, wait_for, worker_pair

SPEC = SpecConfig("ngram", num_tokens=4, adaptive=False)


def _looping_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        span = torch.randint(2, 1000, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
        head = torch.randint(2, 1000, (int(torch.randint(1, 50, (1,), generator=g)),), generator=g).tolist()
        out.append(head + span + head[-2:] + span)
    return out


@pytest.mark.parametrize("transport", ["fake", "tcp", "grpc", "torch"])
def test_disaggregated_greedy_equals_colocated_without_speculation(tiny_model_dir, reference, transport):
    prompts = _looping_prompts(4, seed=1)
    params = [SamplingParams(max_tokens=20 + 4 * i, temperature=0.0, ignore_eos=True, n=2 if i == 3 else 1)
              for i in range(4)]
    want = {}
    for i, (p, prm) in enumerate(zip(prompts, params)):
        for seq, tokens in enumerate(reference([p], prm)):
            want[(f"s{i}", seq)] = tokens
    prefill, decode, _ = worker_pair(tiny_model_dir, transport=transport, speculative=SPEC)
    try:
        c = Collector(expected=len(prompts))
        for i, (p, prm) in enumerate(zip(prompts, params)):           # all in flight together
            job = prefill_job(f"s{i}", p, prm, decode.endpoint)
            decode.submit(decode_job(f"s{i}", p, prm, transfer_id=job.transfer_id), c.sink(f"s{i}"))
            prefill.submit(job, lambda r: None)
        assert c.done.wait(120)
        got = {}
        for rid, events in c.events.items():
            for ev in events:
                got.setdefault((rid, ev.index), []).extend(ev.token_ids)
        assert got == want
        finals = [ev for events in c.events.values() for ev in events if ev.finish_reason]
        assert sum(ev.num_spec_proposed_tokens for ev in finals) == decode.engine.speculator.num_proposed > 0
        assert sum(ev.num_spec_accepted_tokens for ev in finals) == decode.engine.speculator.num_accepted > 0
        stats = decode.stats()
        assert stats["spec_accepted_tokens"] == decode.engine.speculator.num_accepted
        wait_blocks_returned(prefill.engine, decode.engine)
    finally:
        prefill.stop()
        decode.stop()


def test_a_migrated_request_continues_identically(tiny_model_dir, reference):
    prompt = _looping_prompts(1, seed=2)[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    full = reference([prompt], params)[0]
    prefill, decode, _ = worker_pair(tiny_model_dir, speculative=SPEC)
    try:
        c = Collector()
        decode.submit(decode_job("m", prompt, params, resume=full[:11], resume_text_chars=0), c.sink("m"))
        assert c.done.wait(60)
        assert c.tokens("m") == full[11:]
        assert wait_for(lambda: not decode.engine.requests)
        assert decode.engine.speculator.num_accepted > 0
        wait_blocks_returned(decode.engine)
    finally:
        prefill.stop()
        decode.stop()


def test_colocated_worker_greedy_equals_the_engine_without_speculation(tiny_model_dir, reference):
    from decode_worker.colocated import ColocatedWorker
    from engine import Engine, EngineArgs
    prompts = _looping_prompts(5, seed=3)
    params = [SamplingParams(max_tokens=16 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    worker = ColocatedWorker(Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=256, speculative=SPEC)))
    worker.start()
    try:
        c = Collector(expected=5)
        for i, (p, prm) in enumerate(zip(prompts, params)):
            worker.submit(decode_job(f"c{i}", p, prm), c.sink(f"c{i}"))
        assert c.done.wait(60)
        assert [c.tokens(f"c{i}") for i in range(5)] == reference(prompts, params)
        assert worker.stats()["spec_accepted_tokens"] > 0
        wait_blocks_returned(worker.engine)
    finally:
        worker.stop()


def test_a_draft_model_on_the_decode_actor_prefills_its_draft_after_the_handoff(tiny_model_dir, reference):
    """Only the target's KV crosses the handoff; the decode actor's draft (here the target itself, so every
    proposal stands) computes the prompt on its own before its first proposals."""
    prompts = _looping_prompts(3, seed=4)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    draft = SpecConfig("draft", num_tokens=3, adaptive=False, draft_model=tiny_model_dir)
    prefill, decode, _ = worker_pair(tiny_model_dir, speculative=draft)
    try:
        c = Collector(expected=len(prompts))
        for i, p in enumerate(prompts):
            job = prefill_job(f"d{i}", p, params, decode.endpoint)
            decode.submit(decode_job(f"d{i}", p, params, transfer_id=job.transfer_id), c.sink(f"d{i}"))
            prefill.submit(job, lambda r: None)
        assert c.done.wait(120)
        assert [c.tokens(f"d{i}") for i in range(3)] == reference(prompts, params)
        spec = decode.engine.speculator
        assert spec.num_accepted == spec.num_proposed > 0
        wait_blocks_returned(prefill.engine, decode.engine)
        spec.draft.block_manager.check_no_leaks()
    finally:
        prefill.stop()
        decode.stop()
