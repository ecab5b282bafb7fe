"""Logprobs and prompt logprobs equal log_softmax of Hugging Face transformers' logits (float32)."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf(model_dirs):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dirs["gqa_untied"], dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        """[len(ids), V]: log-probabilities of the next token at every position."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 512, (n,), generator=g).tolist()


def _check(entry, token: int, expected: torch.Tensor, k: int) -> None:
    """One TokenLogprob against the HF log-probabilities of its position."""
    assert entry.token_id == token
    assert abs(entry.logprob - expected[token].item()) <= ATOL
    values, ids = expected.topk(k)
    assert [t.token_id for t in entry.top] == ids.tolist()
    assert [t.logprob for t in entry.top] == pytest.approx(values.tolist(), abs=ATOL)


def test_greedy_token_logprobs_and_prompt_logprobs_match_hf_across_chunks(model_dirs, hf):
    # chunk_size 16: a 50-token prompt is computed in 4 chunks, each giving its rows.
    engine = Engine(EngineArgs(model_dirs["gqa_untied"], dtype="float32", num_blocks=128, block_size=16, chunk_size=16))
    prompts = [_prompt(50, 1), _prompt(23, 2), _prompt(1, 3)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=3),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),      # batched beside, asks nothing
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0)]
    done = engine.generate(prompts, params)
    assert done[1].logprobs is None and done[1].prompt_logprobs is None
    for prompt, p, c in zip(prompts, params, done):
        if p.logprobs is None:
            continue
        expected = hf(prompt + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert token == int(expected[len(prompt) - 1 + j].argmax())           # greedy = HF's argmax
            _check(entry, token, expected[len(prompt) - 1 + j], p.logprobs)
        assert len(c.prompt_logprobs) == len(prompt) - 1
        for i, entry in enumerate(c.prompt_logprobs):
            _check(entry, prompt[i + 1], expected[i], p.prompt_logprobs)
        assert c.cumulative_logprob == pytest.approx(sum(e.logprob for e in c.logprobs), abs=1e-3)
    engine.block_manager.check_no_leaks()


def test_prompt_logprobs_take_no_prefix_hits_and_survive_preemption(model_dirs, hf):
    engine = Engine(EngineArgs(model_dirs["gqa_untied"], dtype="float32", num_blocks=64, block_size=16, chunk_size=16))
    prompt = _prompt(60, 4)
    warm = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0].num_cached_tokens == 48
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    rid = engine.add_request(prompt, params)
    req = engine.requests[rid]
    engine.step()
    engine.step()                                    # 32 of 60 prompt positions computed and scored
    assert req.num_computed_tokens == 32 and req.num_cached_tokens == 0 and len(req.prompt_logprobs) == 32
    # What the scheduler does when it runs out of blocks: free them, recompute from the start.
    engine.scheduler.running.remove(req)
    engine.scheduler._preempt(req)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, False]
    assert outs[0].num_cached_tokens == 0
    expected = hf(prompt)
    assert len(outs[0].prompt_logprobs) == len(prompt) - 1
    for i, entry in enumerate(outs[0].prompt_logprobs):
        _check(entry, prompt[i + 1], expected[i], 2)
    assert [t for o in outs for t in o.new_token_ids][:2] == warm.token_ids
    engine.block_manager.check_no_leaks()


def test_prefill_only_output_carries_prompt_and_first_token_logprobs(model_dirs, hf):
    engine = Engine(EngineArgs(model_dirs["gqa_untied"], dtype="float32", num_blocks=64, block_size=16, chunk_size=16))
    prompt = _prompt(40, 5)
    engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0, logprobs=4, prompt_logprobs=1),
                       request_id="p", prefill_only=True)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    [out] = outs
    assert out.prefilled and len(out.prompt_logprobs) == 39 and len(out.logprobs) == 1
    expected = hf(prompt)
    _check(out.logprobs[0], out.new_token_ids[0], expected[-1], 4)
    for i, entry in enumerate(out.prompt_logprobs):
        _check(entry, prompt[i + 1], expected[i], 1)
    engine.release("p")
    engine.block_manager.check_no_leaks()


def test_sampled_tokens_logprobs_are_of_the_raw_logits(model_dirs, hf):
    """Temperature, penalties and logit_bias change the draw, never the reported logprobs."""
    engine = Engine(EngineArgs(model_dirs["gqa_untied"], dtype="float32", num_blocks=64, block_size=16))
    prompt = _prompt(20, 6)
    params = SamplingParams(max_tokens=10, temperature=1.7, top_k=50, repetition_penalty=1.3, seed=5,
                            logit_bias={7: 3.0}, ignore_eos=True, logprobs=2)
    [c] = engine.generate([prompt], params)
    expected = hf(prompt + c.token_ids)
    for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        _check(entry, token, expected[len(prompt) - 1 + j], 2)
    engine.block_manager.check_no_leaks()
