"""Decode-side prefix reuse: a decode actor keeps the blocks of finished requests cached (prompt and
output), pins the leading run a later prompt shares, and the prefill actor ships only the rest; the
tokens equal the colocated engine's on every transport, and however a request ends nothing is held."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams, prompt_block_hashes
from proto.pdserve.v1 import worker_pb2 as wpb
from worker_support import Collector, decode_job, prefill_job, wait_blocks_returned, wait_for, worker_pair

BLOCK_SIZE = 16                       # the engine's default
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _block_nbytes(engine) -> int:
    return engine.kv_cache[:, 0].numel() * engine.kv_cache.element_size()


def _hits(decode, prompt: list[int]) -> int:
    """What the router asks: leading blocks of the prompt the decode actor holds (last token's block excluded)."""
    most = (len(prompt) - 1) // BLOCK_SIZE
    query = wpb.PrefixQuery(block_hashes=prompt_block_hashes(prompt, BLOCK_SIZE)[:most])
    return decode.cached_prefix(query).num_cached_blocks


def _turn(prefill, decode, rid: str, prompt: list[int], params: SamplingParams = PARAMS, skip: int | None = None):
    """One disaggregated request that reuses the decode actor's cached prefix; (tokens, result, pinned)."""
    pinned = _hits(decode, prompt)
    c, results = Collector(), []
    job = prefill_job(rid, prompt, params, decode.endpoint, skip_blocks=pinned if skip is None else skip)
    decode.submit(decode_job(rid, prompt, params, transfer_id=job.transfer_id, num_cached_blocks=pinned),
                  c.sink(rid))
    prefill.submit(job, results.append)
    assert c.done.wait(30) and wait_for(lambda: results, 10)
    return c, results[0], pinned


def _conversation(num_turns: int = 3, seed: int = 3) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(2, 1000, (40,), generator=g).tolist()
    users = [torch.randint(2, 1000, (13 + 6 * k,), generator=g).tolist() for k in range(num_turns - 1)]
    return first, users


@pytest.mark.parametrize("transport", ["fake", "grpc", "tcp", "torch"])
def test_multi_turn_ships_only_the_new_blocks_and_equals_colocated(tiny_model_dir, reference, transport):
    prefill, decode, _ = worker_pair(tiny_model_dir, transport=transport)
    try:
        block_bytes = _block_nbytes(decode.engine)
        prompt, users = _conversation()
        previous = None                  # (prompt, output) of the turn before
        for k in range(len(users) + 1):
            if previous is not None:
                prompt = previous[0] + previous[1] + users[k - 1]
            before = decode.receiver.stats.bytes_received
            c, result, pinned = _turn(prefill, decode, f"t{k}", prompt)
            tokens = c.tokens(f"t{k}")
            assert tokens == reference([prompt], [PARAMS])[0]
            # The decode actor computed the previous prompt and all but the last output token: their full blocks.
            expected = 0 if previous is None else min((len(previous[0]) + len(previous[1]) - 1) // BLOCK_SIZE,
                                                      (len(prompt) - 1) // BLOCK_SIZE)
            assert pinned == expected and (k == 0 or pinned > 0)
            shipped = -(-len(prompt) // BLOCK_SIZE) - pinned
            assert result.status == wpb.PREFILL_STATUS_SENT and result.num_skipped_blocks == pinned
            assert result.kv_bytes == shipped * block_bytes
            assert wait_for(lambda: decode.receiver.stats.bytes_received - before == shipped * block_bytes)
            # cached_tokens: what the prefill actor did not compute (its own cache: the previous prompt's blocks).
            prefill_hits = 0 if previous is None else len(previous[0]) // BLOCK_SIZE * BLOCK_SIZE
            assert result.num_cached_tokens == prefill_hits
            wait_blocks_returned(prefill.engine, decode.engine)
            previous = (prompt, tokens)
    finally:
        prefill.stop()
        decode.stop()


def test_fp8_ships_only_the_new_blocks_too(tiny_model_dir):
    prefill, decode, _ = worker_pair(tiny_model_dir, codec="fp8")
    try:
        first, users = _conversation(2)
        c, full, _ = _turn(prefill, decode, "a", first)
        c, again, pinned = _turn(prefill, decode, "b", first + c.tokens("a") + users[0])
        assert pinned == (len(first) + PARAMS.max_tokens - 1) // BLOCK_SIZE and again.num_skipped_blocks == pinned
        assert len(c.tokens("b")) == PARAMS.max_tokens and c.events["b"][-1].finish_reason
        shipped = -(-(len(first) + PARAMS.max_tokens + len(users[0])) // BLOCK_SIZE) - pinned
        assert again.kv_bytes == shipped * _block_nbytes(decode.engine) and again.wire_bytes < again.kv_bytes
        wait_blocks_returned(prefill.engine, decode.engine)
    finally:
        prefill.stop()
        decode.stop()


def _cached_turn(pair, reference) -> tuple[list[int], int]:
    """A first turn, then the next prompt and how many of its blocks the decode actor holds."""
    prefill, decode, _ = pair
    first, users = _conversation(2, seed=9)
    c, _, _ = _turn(prefill, decode, "first", first)
    prompt = first + c.tokens("first") + users[0]
    return prompt, _hits(decode, prompt)


def _assert_pins_released(decode, prompt: list[int], pinned: int) -> None:
    """Nothing referenced; the prefix is still cached (unpinned, not freed twice or lost)."""
    wait_blocks_returned(decode.engine)
    assert _hits(decode, prompt) == pinned
    assert not decode.engine.requests and not decode._waiting_kv and not decode.streams


def test_pinned_blocks_are_held_while_waiting_and_released_when_the_kv_never_comes(pair, reference):
    _, decode, _ = pair
    prompt, pinned = _cached_turn(pair, reference)
    c = Collector()
    decode.submit(decode_job("w", prompt, PARAMS, transfer_id="never", kv_timeout_s=0.3, num_cached_blocks=pinned),
                  c.sink("w"))
    assert wait_for(lambda: "w" in decode.engine.requests)
    assert decode.engine.block_manager.num_used_blocks == pinned      # the pins, nothing reserved yet
    assert c.done.wait(5)
    error = c.events["w"][-1].error
    assert error.code == 4 and error.retryable                        # DEADLINE_EXCEEDED
    _assert_pins_released(decode, prompt, pinned)


def test_abort_while_waiting_releases_the_pinned_blocks(pair, reference):
    _, decode, _ = pair
    prompt, pinned = _cached_turn(pair, reference)
    c = Collector()
    decode.submit(decode_job("w", prompt, PARAMS, transfer_id="t-w", num_cached_blocks=pinned), c.sink("w"))
    assert wait_for(lambda: decode.engine.block_manager.num_used_blocks == pinned)
    decode.abort("w")
    assert c.done.wait(5) and c.events["w"][-1].finish_reason == 3  # FINISH_REASON_ABORT
    _assert_pins_released(decode, prompt, pinned)


def test_a_failed_transfer_frees_the_reserved_blocks_and_unpins_the_cached_ones(pair, reference):
    prefill, decode, hub = pair
    prompt, pinned = _cached_turn(pair, reference)
    hub.tamper = lambda frame: frame[:-3] + b"xyz"
    c, result, _ = _turn(prefill, decode, "bad", prompt)
    error = c.events["bad"][-1].error
    assert error.code == 14 and error.retryable and "transfer" in error.message     # UNAVAILABLE
    assert result.status == wpb.PREFILL_STATUS_FAILED and result.retryable
    wait_blocks_returned(prefill.engine)
    _assert_pins_released(decode, prompt, pinned)


def test_a_prefix_evicted_before_the_job_is_a_retryable_error_that_holds_nothing(pair, reference):
    prefill, decode, _ = pair
    prompt, pinned = _cached_turn(pair, reference)
    bm = decode.engine.block_manager
    bm.free(bm.allocate(bm.num_free_blocks))             # another request's blocks evicted the whole cache
    c = Collector()
    decode.submit(decode_job("x", prompt, PARAMS, transfer_id="t-x", num_cached_blocks=pinned), c.sink("x"))
    assert c.done.wait(5)
    error = c.events["x"][-1].error
    assert error.code == 14 and error.retryable and "cached prefix" in error.message
    results = []                                 # the prefill actor's transfer is refused, nothing reserved
    prefill.submit(prefill_job("x", prompt, PARAMS, decode.endpoint, transfer_id="t-x", skip_blocks=pinned),
                   results.append)
    assert wait_for(lambda: results, 10) and results[0].status == wpb.PREFILL_STATUS_FAILED
    wait_blocks_returned(prefill.engine)
    _assert_pins_released(decode, prompt, 0)


def test_a_transfer_that_skips_other_blocks_than_were_pinned_is_refused_and_frees_all(pair, reference):
    prefill, decode, _ = pair
    prompt, pinned = _cached_turn(pair, reference)
    c, result, _ = _turn(prefill, decode, "m", prompt, skip=pinned - 1)
    error = c.events["m"][-1].error
    assert error.code == 13 and "skipped" in error.message                          # INTERNAL
    wait_blocks_returned(prefill.engine)
    _assert_pins_released(decode, prompt, pinned)


def test_skipping_the_last_tokens_block_is_refused_on_both_sides(pair):
    prefill, decode, _ = pair
    prompt = list(range(2, 2 + 2 * BLOCK_SIZE))          # 2 full blocks: at most 1 may be skipped
    c, results = Collector(), []
    decode.submit(decode_job("z", prompt, PARAMS, transfer_id="t-z", num_cached_blocks=2), c.sink("z"))
    prefill.submit(prefill_job("z", prompt, PARAMS, decode.endpoint, skip_blocks=2), results.append)
    assert c.done.wait(5) and wait_for(lambda: results, 5)
    assert c.events["z"][-1].error.code == 3 and "num_cached_blocks" in c.events["z"][-1].error.message
    assert results[0].status == wpb.PREFILL_STATUS_FAILED and "skip_blocks" in results[0].error
    assert not results[0].retryable
    wait_blocks_returned(prefill.engine, decode.engine)


def test_kv_that_came_first_is_freed_at_once_when_the_pinned_prefix_is_gone(pair, reference):
    prefill, decode, _ = pair
    prompt, pinned = _cached_turn(pair, reference)
    job = prefill_job("o", prompt, PARAMS, decode.endpoint, skip_blocks=pinned)
    results = []
    prefill.submit(job, results.append)
    assert wait_for(lambda: job.transfer_id in decode._orphans, 10)        # parked: nobody waits yet
    bm = decode.engine.block_manager
    parked = decode._orphans[job.transfer_id][0].dst_block_ids
    bm.free(bm.allocate(bm.num_free_blocks))             # the cached prefix is evicted meanwhile
    c = Collector()
    decode.submit(decode_job("o", prompt, PARAMS, transfer_id=job.transfer_id, num_cached_blocks=pinned),
                  c.sink("o"))
    assert c.done.wait(5) and c.events["o"][-1].error.retryable
    assert len(parked) == -(-len(prompt) // BLOCK_SIZE) - pinned and not decode._orphans
    _assert_pins_released(decode, prompt, 0)


def test_n_sequences_fork_over_pinned_and_received_blocks(pair, reference):
    prefill, decode, _ = pair
    prompt, pinned = _cached_turn(pair, reference)
    params = SamplingParams(n=2, max_tokens=6, temperature=0.9, seed=11, ignore_eos=True)
    c, result, got_pinned = _turn(prefill, decode, "n2", prompt, params)
    assert got_pinned == pinned > 0 and result.num_skipped_blocks == pinned
    assert wait_for(lambda: sum(bool(ev.finish_reason) for ev in c.events["n2"]) == 2, 10)   # both sequences
    by_index: dict[int, list[int]] = {}
    for ev in c.events["n2"]:
        by_index.setdefault(ev.index, []).extend(ev.token_ids)
    assert [by_index[0], by_index[1]] == reference([prompt], [params])
    wait_blocks_returned(prefill.engine, decode.engine)
