"""The engine's per-layer hook: exact call order, the blocks each call names, the rows final when told."""
from __future__ import annotations

import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.runner.layer_hook import LayerDone


def _engine(model_dir: str) -> Engine:
    # block_size 4, chunks of 8 tokens, 12 tokens per step: a 10-token prompt takes two chunks
    return Engine(EngineArgs(model_dir, dtype="float32", num_blocks=32, block_size=4, chunk_size=8,
                             max_num_batched_tokens=12, attention="eager"))


def test_hook_names_each_layers_final_blocks_in_order(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    calls: list[tuple[int, list[tuple[str, list[int], bool]]]] = []
    rows: dict[tuple[int, int], torch.Tensor] = {}      # (layer, block) -> its rows when the hook named it

    def hook(done: LayerDone) -> None:
        assert done.ready is None                      # CPU: the rows are written already
        calls.append((done.layer, [(f.request.request_id, f.block_ids, f.prompt_done) for f in done.blocks]))
        for f in done.blocks:
            for block in f.block_ids:
                rows[done.layer, block] = engine.kv_cache[done.layer, block].clone()

    engine.layer_hook = hook
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    out = engine.generate([list(range(10, 20)), [7, 8, 9, 10, 11]], [params, params])
    layers = range(engine.config.num_hidden_layers)
    # step 1: a = tokens 0..7 (blocks 0, 1 full), b = tokens 0..3 (block 2 full);
    # step 2: a's last 2 tokens (its tail block 3), b's last token (tail block 4); decodes: no call
    want = ([(i, [("a", [0, 1], False), ("b", [2], False)]) for i in layers]
            + [(i, [("a", [3], True), ("b", [4], True)]) for i in layers])
    rid = {c.request_id: name for c, name in zip(out, "ab")}
    assert [(layer, [(rid[r], ids, done) for r, ids, done in blocks]) for layer, blocks in calls] == want
    # what each call named was final then: the prompt rows equal the cache after generation
    # (tail blocks 3 and 4 then also hold decoded tokens past the prompt: compare the prompt rows)
    for (layer, block), before in rows.items():
        after = engine.kv_cache[layer, block]
        prompt_rows = {3: 2, 4: 1}.get(block, 4)
        assert torch.equal(before[:, :, :prompt_rows], after[:, :, :prompt_rows]), (layer, block)


def test_prefix_hits_are_final_before_the_first_call(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([list(range(30, 39))], params)          # blocks of tokens 0..7 are cached now
    calls = []
    engine.layer_hook = lambda done: calls.append((done.layer, [(f.start_block, f.end_block) for f in done.blocks]))
    [c] = engine.generate([list(range(30, 40))], params)
    assert c.num_cached_tokens == 8
    assert calls == [(i, [(2, 3)]) for i in range(engine.config.num_hidden_layers)]


def test_a_hook_changes_no_output(tiny_model_dir):
    hooked, plain = _engine(tiny_model_dir), _engine(tiny_model_dir)
    hooked.layer_hook = lambda done: None
    prompts = [list(range(5, 25)), list(range(100, 107)), list(range(3, 16))]
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)] * 3
    got, want = hooked.generate(prompts, params), plain.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [[lp.logprob for lp in c.logprobs] for c in got] == [[lp.logprob for lp in c.logprobs] for c in want]


def test_final_blocks_with_chunks_across_block_edges():
    from engine.runner.layer_hook import final_blocks
    from engine.scheduling.request import Request
    req = Request("r", list(range(10)), SamplingParams(), seed=0)
    req.block_table = [7, 3, 9]
    # chunks of 6 tokens, blocks of 4: block 1 (tokens 4..7) gets its last rows in the second chunk
    first, second = final_blocks(req, 0, 6, 4), final_blocks(req, 6, 4, 4)
    assert (first.start_block, first.end_block, first.prompt_done, first.block_ids) == (0, 1, False, [7])
    assert (second.start_block, second.end_block, second.prompt_done, second.block_ids) == (1, 3, True, [3, 9])
    assert final_blocks(req, 1, 2, 4).block_ids == []       # tokens 1..2: no block full yet
    assert final_blocks(req, 2, 2, 4).block_ids == [7]      # tokens 2..3 fill block 0
    assert final_blocks(req, 10, 1, 4) is None              # a decode step computes no prompt token
