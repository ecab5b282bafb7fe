"""Decode steps through the static buffers of engine/runner/decode_graphs.py (padded batch buckets, fixed-width
page lists, a scratch block for the padding) equal the plain path token for token. On CPU the graphs are
not captured; tests/gpu/test_attention_flex_gpu.py replays them on CUDA."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.runner.decode_graphs import DecodeGraphs
from window_support import one_thread, random_prompts, write_window_model

BLOCK = 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def window_dir(tmp_path_factory) -> str:
    return write_window_model(str(tmp_path_factory.mktemp("graphs-window")))


def test_graph_path_equals_the_plain_path(window_dir, monkeypatch):
    sizes = []
    run = DecodeGraphs.run

    def counting(self, input_ids, positions, seqs):
        sizes.append(len(seqs))
        return run(self, input_ids, positions, seqs)
    monkeypatch.setattr(DecodeGraphs, "run", counting)
    prompts = random_prompts([30, 5, 12, 41, 9], seed=11)
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True, logprobs=0) for i in range(5)]
    results = {}
    for graphs in (True, False):
        engine = Engine(EngineArgs(window_dir, dtype="float32", num_blocks=48, block_size=BLOCK, attention="flex-eager",
                                   chunk_size=12, max_num_batched_tokens=64, max_num_seqs=8, cuda_graphs=graphs))
        if graphs:
            assert sorted(engine.runner.graphs.buckets) == [1, 2, 4, 8]
            assert engine.runner.graphs.scratch_block == 47 and engine.block_manager.num_blocks == 47
        outs = engine.generate(prompts, params)
        engine.block_manager.check_no_leaks()
        results[graphs] = ([c.token_ids for c in outs], [[lp.logprob for lp in c.logprobs] for c in outs])
    # batches shrink as requests finish: buckets 8, 4, 2 and 1 all served (5 -> 4 -> ... -> 1 sequences)
    assert {1, 2, 3, 4, 5} <= set(sizes)
    assert results[True][0] == results[False][0]
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)


def test_graphs_need_the_flex_kernel(window_dir, caplog):
    engine = Engine(EngineArgs(window_dir, dtype="float32", num_blocks=48, block_size=BLOCK, attention="eager",
                               cuda_graphs=True))
    assert engine.runner.graphs is None and engine.block_manager.num_blocks == 48
    assert "cuda_graphs needs the flex attention kernel" in caplog.text
