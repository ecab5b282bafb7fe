"""Tensor parallelism over two gloo ranks (two processes): greedy tokens and logits equal the one-rank engine,
and the logits Hugging Face transformers computes for the same checkpoint.

Every architecture the engine supports runs split over 2 ranks in float32: Llama with GQA from a sharded
checkpoint, tied MHA, Llama with q/k/v, o_proj and MLP biases (row-parallel biases added once), Qwen2 with
one KV head (replicated on both ranks), Mistral with a sliding window, Qwen3's per-head q/k norm and
Phi-3's fused qkv / gate_up projections. Prompts are chunked, batched and include n = 2 (a forked
sequence: the block copy must reach rank 1 too). A rank's death fails the other's next step (no hang);
a degree that does not fit the model is a ValueError naming the key and the head counts.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import time

import pytest
import torch
from hf_checkpoints import random_prompt, write_checkpoint
from tp_support import JOIN_S, Follower

from engine import Engine, EngineArgs, SamplingParams
from engine.model.config import ModelConfig
from engine.parallel.group import RankGroupError
from engine.parallel.shard import kv_head_ranges, shard_heads
from window_support import write_window_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-4           # float32 logits: the all-reduce sums in another order than one rank's matmul
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def follower():
    f = Follower()
    yield f
    f.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_dirs, tiny_model_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    common = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, pad_token_id=None, rms_norm_eps=1e-6)
    hf = {
        "llama_biases": transformers.LlamaConfig(**common, attention_bias=True, mlp_bias=True),
        "qwen3": transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
        "phi3": transformers.Phi3Config(**common, sliding_window=None, partial_rotary_factor=0.75),
    }
    dirs = {name: write_checkpoint(str(root / name), cfg, tiny_model_dir, seed=n) for n, (name, cfg) in
            enumerate(hf.items())}
    dirs["mistral_window"] = write_window_model(str(root / "mistral_window"))
    return {**{k: model_dirs[k] for k in ("gqa_untied", "mha_tied", "qwen2_bias")}, **dirs}


def _args(model_dir: str, **kw) -> EngineArgs:
    return EngineArgs(model_dir, dtype="float32", num_blocks=96, block_size=4, chunk_size=24, attention="eager",
                      weight_layout="row-major", torch_threads=1, **kw)


def _prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(n, seed=n, vocab=vocab) for n in (37, 9, 61)]


def _run(engine: Engine) -> tuple[list[list[int]], torch.Tensor]:
    vocab = min(engine.vocab_size, 250)
    prompts = _prompts(vocab)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = [c.token_ids for c in engine.generate(prompts, greedy)]
    fork = random_prompt(27, seed=27, vocab=vocab)       # not cached: its partial block is copied to sequence 1
    tokens += [c.token_ids for c in engine.generate([fork], dataclasses.replace(greedy, n=2))]
    blocks = engine.block_manager.allocate(16)
    logits = engine.runner.score(prompts[2], blocks)
    engine.block_manager.free(blocks)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return tokens, logits


@pytest.mark.parametrize("name", ["gqa_untied", "mha_tied", "llama_biases", "qwen2_bias", "mistral_window",
                                  "qwen3", "phi3"])
def test_two_ranks_generate_what_one_rank_does(follower, checkpoints, name):
    args = _args(checkpoints[name])
    want_tokens, want_logits = _run(Engine(args))
    with follower.engine(args) as engine:
        cfg, layer = engine.config, engine.model.layers[0]
        assert engine.tp.size == 2 and engine.kv_cache.shape[3] == max(cfg.num_key_value_heads // 2, 1)
        # rank 0 holds its half of every projection (the LM head and the embedding whole)
        assert layer.gate_up_proj.weight.shape == (cfg.intermediate_size, cfg.hidden_size)
        assert layer.o_proj.weight.shape == (cfg.hidden_size, cfg.num_attention_heads // 2 * cfg.head_dim)
        tokens, logits = _run(engine)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32).eval()
    with torch.no_grad():                                                 # and Hugging Face's own forward
        ref = hf(torch.tensor([_prompts(min(engine.vocab_size, 250))[2]])).logits[0]
    torch.testing.assert_close(logits, ref[:, :logits.shape[-1]], atol=ATOL, rtol=0)
    with pytest.raises(RankGroupError, match="the group is closed"):      # closed: no step runs on half a model
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("setting", [{"attention": "compiled"}, {"attention": "flex-eager"},
                                     {"kv_cache_dtype": "fp8"}], ids=["compiled", "flex-eager", "fp8-cache"])
def test_two_ranks_on_every_attention_path_and_a_quantized_cache(follower, checkpoints, setting):
    """The decode kernels built for a rank's heads, and an fp8 cache (its scales are per KV head, so a
    rank's share quantizes as on one rank), give the one-rank engine's tokens."""
    args = dataclasses.replace(_args(checkpoints["gqa_untied"]), **setting)
    want_tokens, want_logits = _run(Engine(args))
    with follower.engine(args) as engine:
        assert engine.attention == args.attention if "attention" in setting else engine.kv_format.quantized
        tokens, logits = _run(engine)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=0)


def test_two_ranks_verify_speculative_proposals_as_one_rank_decodes(follower, checkpoints):
    """n-gram speculation on rank 0 (proposals, verification, rollback): the followers run the 1 + k query
    rows it plans, and the tokens are the one-rank engine's without speculation."""
    from engine.spec.config import SpecConfig
    plain = _args(checkpoints["gqa_untied"])
    repeat = [7, 8, 9, 10, 11, 12] * 6                     # the prompt repeats itself: proposals get accepted
    prompts = [repeat, random_prompt(30, seed=5, vocab=250)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in Engine(plain).generate(prompts, greedy)]
    args = dataclasses.replace(plain, speculative=SpecConfig(method="ngram", num_tokens=3, adaptive=False))
    with follower.engine(args) as engine:
        got = [c.token_ids for c in engine.generate(prompts, greedy)]
        accepted = engine.speculator.num_accepted
        engine.block_manager.check_no_leaks()
    assert got == want and accepted > 0


def test_kv_heads_split_or_replicated_as_the_ranks_need(checkpoints):
    gqa, one_kv = (ModelConfig.from_dir(checkpoints[n]) for n in ("gqa_untied", "qwen2_bias"))
    assert kv_head_ranges(gqa, 2) == [range(0, 1), range(1, 2)]
    assert kv_head_ranges(gqa, 4) == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert kv_head_ranges(one_kv, 2) == [range(0, 1), range(0, 1)]
    shard = shard_heads(gqa, 4, 3)
    assert (shard.head_start, shard.num_heads, shard.intermediate_start, shard.intermediate_size) == (3, 1, 192, 64)


def test_a_degree_that_does_not_divide_the_heads_is_refused(checkpoints):
    with pytest.raises(ValueError, match=r"tensor_parallel 3 does not divide the model's 4 attention heads "
                                         r"\(2 KV heads\)"):
        Engine(_args(checkpoints["gqa_untied"], tensor_parallel=3))
    with pytest.raises(ValueError, match="tensor_parallel 2: quantized projections \\(int8\\) are not sharded"):
        Engine(_args(checkpoints["gqa_untied"], tensor_parallel=2, quantization="int8"))


def test_a_dead_rank_fails_the_step_instead_of_hanging(checkpoints):
    """Rank 1 killed: rank 0's next step raises RankGroupError promptly; no rank waits out a hang."""
    follower = Follower()
    try:
        args = dataclasses.replace(follower.start(_args(checkpoints["gqa_untied"])), tensor_parallel_timeout_s=20)
        engine = Engine(args)
        prompt = random_prompt(20, seed=3, vocab=250)
        engine.add_request(prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        engine.step()
        follower.process.kill()
        follower.process.join(JOIN_S)
        began = time.monotonic()
        with pytest.raises(RankGroupError, match="rank 0 of 2: all-reduce failed"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - began < 20
    finally:
        follower.close()


def _rank0_then_die(args: EngineArgs) -> None:
    engine = Engine(args)
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0.0))
    import os
    os._exit(0)          # rank 0 dies without closing the group


def test_a_follower_returns_an_error_when_rank_0_dies(checkpoints):
    follower = Follower()
    try:
        args = dataclasses.replace(follower.start(_args(checkpoints["gqa_untied"])))
        rank0 = multiprocessing.get_context("spawn").Process(target=_rank0_then_die, args=(args,))
        rank0.start()
        rank0.join(JOIN_S)
        ended = follower.ended()
        assert ended != "closed" and "Error" in ended.split(":")[0]
    finally:
        follower.close()
