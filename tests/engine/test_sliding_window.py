"""Mistral's sliding window: tokens and logits equal HF transformers (eager attention, whose mask
honours the window) through prefill, chunked prefill (chunks shorter and longer than the window),
decode and prefix-cache hits; blocks wholly outside every sequence's window go back to the pool."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.kv_cache.block_manager import FREED
from window_support import WINDOW, hf_greedy, hf_logits, hf_model, one_thread, random_prompts, write_window_model

pytest.importorskip("transformers")

BLOCK = 4           # window 16 = 4 blocks: the window moves over many block boundaries
MAX_TOKENS = 64


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def window_dir(tmp_path_factory) -> str:
    return write_window_model(str(tmp_path_factory.mktemp("mistral-window")))


@pytest.fixture(scope="module")
def hf(window_dir):
    return hf_model(window_dir)


def _engine(model_dir: str, **kw) -> Engine:
    kw = {"dtype": "float32", "num_blocks": 160, "block_size": BLOCK, "attention": "eager", **kw}
    return Engine(EngineArgs(model_dir, **kw))


def test_prefill_logits_match_hf_and_the_window_matters(window_dir, hf, tmp_path):
    engine = _engine(window_dir)
    assert engine.config.sliding_window == WINDOW
    ids = random_prompts([70], seed=1)[0]
    blocks = engine.block_manager.allocate(-(-len(ids) // BLOCK))
    ours = engine.runner.score(ids, blocks)
    engine.block_manager.free(blocks)
    theirs = hf_logits(hf, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # the same weights without a window give other logits past the window: the test can fail
    full = hf_logits(hf_model(write_window_model(str(tmp_path / "full"), sliding_window=None)), ids)
    assert (full[:WINDOW] - theirs[:WINDOW]).abs().max() < 1e-4
    assert (full[WINDOW:] - theirs[WINDOW:]).abs().max() > 1e-2


def _check_against_hf(hf, prompts: list[list[int]], outputs: list[tuple[list[int], list[float]]]) -> None:
    """Per sequence (tokens, logprobs): each token is HF's argmax given the tokens before it (so HF's
    greedy generate gives the same tokens), and its logprob equals HF's over the whole sequence."""
    for prompt, (tokens, logprobs) in zip(prompts, outputs):
        assert len(tokens) == MAX_TOKENS
        logits = hf_logits(hf, prompt + tokens)[len(prompt) - 1:-1]          # [MAX_TOKENS, V]
        assert tokens == logits.argmax(-1).tolist()
        want = torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(logprobs), want, atol=1e-4, rtol=1e-4)


def _outputs(completions) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, [lp.logprob for lp in c.logprobs]) for c in completions]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


def test_greedy_generation_matches_hf_generate(window_dir, hf):
    engine = _engine(window_dir)
    prompt = random_prompts([41], seed=2)[0]
    assert engine.generate([prompt], GREEDY)[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)


@pytest.mark.parametrize("chunk_size", [None, 8, 24], ids=["whole", "chunk-lt-window", "chunk-gt-window"])
def test_batched_generation_matches_hf(window_dir, hf, chunk_size):
    engine = _engine(window_dir, chunk_size=chunk_size, max_num_batched_tokens=256)
    prompts = random_prompts([41, 70, 5], seed=2)
    _check_against_hf(hf, prompts, _outputs(engine.generate(prompts, GREEDY)))
    engine.block_manager.check_no_leaks()


def test_prefix_cache_hits_match_hf(window_dir, hf):
    engine = _engine(window_dir, chunk_size=8)
    base = random_prompts([48], seed=3)[0]
    prompts = [base + tail for tail in random_prompts([3, 9], seed=4)]
    first = engine.generate(prompts[:1], GREEDY)
    second = engine.generate(prompts[1:], GREEDY)     # the shared 48 tokens come from the cache
    assert second[0].num_cached_tokens == 48
    _check_against_hf(hf, prompts, _outputs(first + second))
    engine.block_manager.check_no_leaks()


def test_blocks_outside_the_window_are_freed_as_it_moves(window_dir):
    engine = _engine(window_dir, chunk_size=8)
    bm = engine.block_manager
    rid = engine.add_request(random_prompts([40], seed=5)[0],
                             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    req = engine.requests[rid]
    free_counts, done = [], False
    while not done:
        done = any(o.finish_reason for o in engine.step())
        if done:
            break
        computed = req.num_computed_tokens
        live = [b for b in req.block_table if b != FREED]
        # exactly the blocks from the next query's window start to the last computed token's
        first = max(computed - WINDOW + 1, 0) // BLOCK
        assert req.block_table[:first] == [FREED] * first
        assert len(live) == -(-computed // BLOCK) - first == bm.num_used_blocks
        assert len(live) <= WINDOW // BLOCK + 1
        free_counts.append(bm.num_free_blocks)
    # the free count grows while the request still runs (a block leaves the window) ...
    assert sum(b > a for a, b in zip(free_counts, free_counts[1:])) >= (40 + MAX_TOKENS - 48) // BLOCK - 2
    bm.check_no_leaks()                    # ... and everything is back at the end


def test_shared_blocks_stay_while_another_sequence_holds_them(window_dir, hf):
    """n=2 forks share the prompt's full blocks: one sequence's release only drops its reference. A tight
    pool and a second request take every block the moment it is free, so a block freed too early would
    be overwritten and change the tokens."""
    engine = _engine(window_dir, num_blocks=24, chunk_size=8, max_num_batched_tokens=64)
    prompts = random_prompts([45, 30], seed=6)
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                        logprobs=0, n=2))
    got: dict[tuple[str, int], tuple[list[int], list[float]]] = {}
    other, shared_refs = None, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens, logprobs = got.setdefault((out.request_id, out.index), ([], []))
            tokens.extend(out.new_token_ids)
            logprobs.extend(lp.logprob for lp in out.logprobs)
        root = engine.requests.get(rid)
        if root is not None and root.sequences:
            a, b = root.sequences
            shared = [x for x, y in zip(a.block_table, b.block_table) if x == y and x != FREED]
            shared_refs.append([engine.block_manager.blocks[x].ref_count for x in shared])
            if other is None:
                other = engine.add_request(prompts[1], GREEDY)
    assert shared_refs[0] and all(r == 2 for refs in shared_refs for r in refs)
    assert not shared_refs[-1]                 # the window moved past the shared prompt blocks
    _check_against_hf(hf, [prompts[0], prompts[0], prompts[1]], [got[rid, 0], got[rid, 1], got[other, 0]])
    engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("kind, tolerance", [("int8", 0.005), ("fp8", 0.02)])
def test_a_quantized_cache_keeps_the_window(window_dir, hf, tmp_path, kind, tolerance):
    """kv_cache.dtype fp8 / int8 under a sliding window, chunked prefill and decode: every token's logprob is
    HF's (the window's) within the cache's rounding, further from a windowless model's than that, and the
    blocks that leave the window go back to the pool."""
    engine = _engine(window_dir, chunk_size=8, max_num_batched_tokens=256, kv_cache_dtype=kind)
    prompts = random_prompts([41, 70], seed=6)
    outputs = _outputs(engine.generate(prompts, GREEDY))
    engine.block_manager.check_no_leaks()
    windowless = hf_model(write_window_model(str(tmp_path / "full"), sliding_window=None))
    for prompt, (tokens, logprobs) in zip(prompts, outputs):
        def logprobs_of(model):
            logits = hf_logits(model, prompt + tokens)[len(prompt) - 1:-1]
            return torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        windowed, unwindowed = logprobs_of(hf), logprobs_of(windowless)
        ours = torch.tensor(logprobs)
        assert (ours - windowed).abs().max() < tolerance
        assert (ours - unwindowed).abs().mean() > 2.5 * tolerance      # the window matters more than rounding
