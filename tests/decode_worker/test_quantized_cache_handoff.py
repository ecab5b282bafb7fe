"""An fp8 / int8 KV cache on both sides of the handoff: the prefill actor ships its blocks as stored, the
decode actor stores them byte for byte and appends to the prompt's partial last block as a colocated engine
would, so the disaggregated tokens equal the colocated engine's with the same cache."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.kv_cache.block_manager import prompt_block_hashes
from kv_transfer import FakeHub, HandshakeError, make_receiver, make_sender
from kv_transfer.codec import stored_codec
from kv_transfer.settings import layout_of
from worker_support import Collector, decode_job, prefill_job, wait_blocks_returned, wait_for, worker_pair

PROMPTS = [list(range(3, 3 + n)) for n in (9, 16, 41)]      # partial last blocks, and one exactly full


@pytest.mark.parametrize("transport", ["fake", "tcp", "grpc"])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_disaggregated_equals_colocated_with_the_same_cache(tiny_model_dir, kind, transport):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    colocated = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=256, kv_cache_dtype=kind))
    want = [colocated.generate([prompt], params)[0].token_ids for prompt in PROMPTS]    # one at a time: batch 1
    prefill, decode, _ = worker_pair(tiny_model_dir, transport=transport, kv_cache_dtype=kind)
    try:
        shipped = {}
        for i, prompt in enumerate(PROMPTS):
            c = Collector()
            job = prefill_job(f"q{i}", prompt, params, decode.endpoint)
            decode.submit(decode_job(f"q{i}", prompt, params, transfer_id=job.transfer_id), c.sink(f"q{i}"))
            prefill.submit(job, lambda r, i=i: shipped.__setitem__(i, r))
            assert c.done.wait(60)
            assert c.tokens(f"q{i}") == want[i]
        assert wait_for(lambda: len(shipped) == len(PROMPTS))
        per_block = prefill.engine.kv_bytes_per_block
        assert all(r.kv_bytes == -(-len(p) // 16) * per_block for r, p in zip(
            (shipped[i] for i in range(len(PROMPTS))), PROMPTS))            # the stored bytes, scales included
        wait_blocks_returned(prefill.engine, decode.engine)
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("transport", ["fake", "tcp"])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_shipped_blocks_arrive_byte_for_byte(tiny_model_dir, kind, transport):
    """The decode actor's copy of a prompt's full blocks is the prefill actor's, bit for bit (both keep them
    in their prefix caches afterwards)."""
    prefill, decode, _ = worker_pair(tiny_model_dir, transport=transport, kv_cache_dtype=kind)
    try:
        prompt, params = list(range(5, 53)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        job = prefill_job("b", prompt, params, decode.endpoint)
        c = Collector()
        decode.submit(decode_job("b", prompt, params, transfer_id=job.transfer_id), c.sink("b"))
        prefill.submit(job, lambda r: None)
        assert c.done.wait(30)
        wait_blocks_returned(prefill.engine, decode.engine)
        hashes = prompt_block_hashes(prompt, 16)
        p_ids = prefill.engine.block_manager.match_prefix(hashes)
        d_ids = decode.engine.block_manager.match_prefix(hashes)
        assert len(p_ids) == len(d_ids) == 3
        assert torch.equal(prefill.engine.kv_cache[:, p_ids], decode.engine.kv_cache[:, d_ids])
    finally:
        prefill.stop()
        decode.stop()


def test_a_cache_stored_otherwise_is_refused_naming_both(tiny_model_dir):
    fp8 = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=16, kv_cache_dtype="fp8"))
    auto = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=16))
    hub = FakeHub()
    receiver = make_receiver("fake", layout_of(auto.kv_cache, auto.fingerprint), auto.kv_cache, auto.block_manager,
                             codec="none", hub=hub)
    sender = make_sender("fake", layout_of(fp8.kv_cache, fp8.fingerprint, fp8.kv_format),
                         codec=stored_codec("fp8"), hub=hub)
    with pytest.raises(HandshakeError, match="cache_dtype: sender='fp8' receiver='auto'"):
        sender.handshake(receiver.endpoint)
