"""min_tokens, stop_token_ids, logit_bias, min_p, include_stop_str_in_output, skip_special_tokens, matched_stop."""
from __future__ import annotations

import math

import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.scheduling.request import Request
from engine.sampling.sampler import sample, top_k_top_p_probs

PROMPT = [5, 6, 7, 8, 9]
EOS = 1


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=128))


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **kw})


def reference_greedy(engine: Engine, prompt: list[int], num_tokens: int, adjust) -> list[int]:
    """Greedy decoding from whole-sequence logits: each token is the argmax of adjust(position, logits)."""
    out: list[int] = []
    for j in range(num_tokens):
        ids = prompt + out
        blocks = engine.block_manager.allocate(-(-len(ids) // engine.block_size))
        logits = engine.runner.score(ids, blocks)[-1].clone()
        engine.block_manager.free(blocks)
        out.append(int(adjust(j, logits).argmax()))
    return out


def test_logit_bias_plus_100_forces_and_minus_100_bans(engine):
    base = engine.generate([PROMPT], _greedy())[0].token_ids
    forced = engine.generate([PROMPT, PROMPT], [_greedy(logit_bias={300: 100.0}),
                                        SamplingParams(max_tokens=12, temperature=1.3, seed=4, ignore_eos=True,
                                                       logit_bias={300: 100.0})])
    assert [c.token_ids for c in forced] == [[300] * 12] * 2
    banned = {base[0]: -100.0, base[1]: -100.0}
    got = engine.generate([PROMPT], _greedy(logit_bias=banned))[0].token_ids
    assert base[0] not in got and base[1] not in got

    def ban(_, logits):
        logits[[base[0], base[1]]] -= 100.0
        return logits
    assert got == reference_greedy(engine, PROMPT, 12, ban)
    engine.block_manager.check_no_leaks()


def test_stop_token_ids_end_with_the_token_kept(engine):
    base = engine.generate([PROMPT], _greedy())[0]
    stop = base.token_ids[3]
    assert stop not in base.token_ids[:3]
    c = engine.generate([PROMPT], _greedy(stop_token_ids=(stop, 1000)))[0]
    assert c.token_ids == base.token_ids[:4] and c.finish_reason == "stop" and c.matched_stop == stop
    assert c.text == engine.tokenizer.decode(base.token_ids[:4])


def test_min_tokens_masks_stop_tokens_and_eos_until_reached(engine):
    base = engine.generate([PROMPT], _greedy())[0].token_ids
    stop = base[0]
    c = engine.generate([PROMPT], _greedy(stop_token_ids=(stop,), min_tokens=4, ignore_eos=False))[0]

    def mask(j, logits):
        if j < 4:
            logits[[stop, EOS]] = float("-inf")
        return logits
    expected = reference_greedy(engine, PROMPT, 12, mask)
    end = next((j for j, t in enumerate(expected) if j >= 4 and t in (stop, EOS)), 11) + 1
    assert c.token_ids == expected[:end]
    assert stop not in c.token_ids[:4] and EOS not in c.token_ids[:4]
    # Forced by bias, the stop token comes at the first position min_tokens allows.
    c = engine.generate([PROMPT], _greedy(stop_token_ids=(stop,), min_tokens=3, logit_bias={stop: 100.0}))[0]
    assert len(c.token_ids) == 4 and c.token_ids[3] == stop and stop not in c.token_ids[:3]
    assert c.finish_reason == "stop" and c.matched_stop == stop
    # The same for EOS; ignore_eos disables only EOS, not the stop tokens.
    c = engine.generate([PROMPT], _greedy(ignore_eos=False, min_tokens=2, logit_bias={EOS: 100.0}))[0]
    assert c.token_ids[2] == EOS and len(c.token_ids) == 3 and c.matched_stop == EOS
    assert c.text == engine.tokenizer.decode(c.token_ids[:2])
    c = engine.generate([PROMPT], _greedy(ignore_eos=True, min_tokens=2, logit_bias={EOS: 100.0}))[0]
    assert c.token_ids == [EOS] * 12 and c.finish_reason == "length" and c.matched_stop is None
    engine.block_manager.check_no_leaks()


def test_eos_text_is_left_out_and_skip_special_tokens_false_keeps_it(engine):
    eos_all = dict(logit_bias={EOS: 100.0}, max_tokens=3)
    assert engine.generate([PROMPT], _greedy(**eos_all))[0].text == ""
    assert engine.generate([PROMPT], _greedy(**eos_all, skip_special_tokens=False))[0].text == "</s>" * 3
    stopped = engine.generate([PROMPT], _greedy(ignore_eos=False, logit_bias={EOS: 100.0}, skip_special_tokens=False))
    assert stopped[0].token_ids == [EOS] and stopped[0].text == "" and stopped[0].matched_stop == EOS
    kept = engine.generate([PROMPT], _greedy(ignore_eos=False, logit_bias={EOS: 100.0}, skip_special_tokens=False,
                                             include_stop_str_in_output=True))
    assert kept[0].text == "</s>"
    as_stop_token = engine.generate([PROMPT], _greedy(stop_token_ids=(EOS,), logit_bias={EOS: 100.0},
                                                      skip_special_tokens=False))
    assert as_stop_token[0].text == "</s>" and as_stop_token[0].matched_stop == EOS


def test_include_stop_str_in_output_keeps_the_matched_string(engine):
    base = engine.generate([PROMPT], _greedy(max_tokens=40))[0]
    stop = base.text[10:13]
    cut = base.text.find(stop)
    for include, text in ((False, base.text[:cut]), (True, base.text[:cut + len(stop)])):
        engine.add_request(PROMPT, _greedy(max_tokens=40, stop=["\x00never", stop], include_stop_str_in_output=include))
        deltas, last = [], None
        while engine.has_unfinished():
            for out in engine.step():
                deltas.append(out.text_delta)
                last = out
        assert "".join(deltas) == text and last.finish_reason == "stop" and last.matched_stop == stop
    engine.block_manager.check_no_leaks()


def test_min_tokens_holds_back_stop_strings(engine):
    # A prompt whose first generated token's text occurs nowhere else in the first 8 tokens' text.
    for prompt in ([5 + i, 6, 7, 8, 9] for i in range(40)):
        base = engine.generate([prompt], _greedy(max_tokens=8))[0]
        stop = engine.tokenizer.decode(base.token_ids[:1])
        if stop and base.text.find(stop, 1) == -1:
            break
    else:
        pytest.fail("no prompt found")
    early = engine.generate([prompt], _greedy(max_tokens=8, stop=[stop]))[0]
    assert early.finish_reason == "stop" and early.text == "" and early.token_ids == base.token_ids[:1]
    late = engine.generate([prompt], _greedy(max_tokens=8, stop=[stop], min_tokens=2))[0]
    assert late.token_ids == base.token_ids and late.finish_reason == "length" and late.text == base.text


def test_min_p_matches_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, generator=g)
    kept = []
    for temperature, min_p in ((1.0, 0.1), (0.7, 0.3), (1.5, 0.05)):
        probs = torch.softmax(logits / temperature, dim=-1)
        keep = probs >= min_p * probs.max()
        expected = torch.where(keep, probs, torch.zeros_like(probs))
        expected /= expected.sum()
        got = top_k_top_p_probs(logits, temperature, 0, 1.0, min_p)
        torch.testing.assert_close(got, expected)
        kept.append(int(keep.sum()))
    assert max(kept) > 1 and min(kept) < 64          # the cases do drop some tokens and keep several
    # After top-k: the threshold is of what top-k kept.
    got = top_k_top_p_probs(logits, 1.0, 5, 1.0, 0.5)
    top = torch.softmax(logits.topk(5).values, -1)
    assert int((got > 0).sum()) == int((top >= 0.5 * top.max()).sum())


def test_min_p_one_keeps_only_the_most_likely_token(engine):
    greedy = engine.generate([PROMPT], _greedy(max_tokens=16))[0].token_ids
    hot = SamplingParams(max_tokens=16, temperature=1.0, seed=3, min_p=1.0, ignore_eos=True)
    assert engine.generate([PROMPT], hot)[0].token_ids == greedy


def test_sampler_order_bias_before_temperature():
    """A +2 bias at temperature 0.5 is worth 4 in the softmax: [0, 0+2] / 0.5 → p = [1, e^4] / (1 + e^4)."""
    logits = torch.tensor([[0.0, 0.0]])
    params = [SamplingParams(temperature=0.5, seed=s, logit_bias={1: 2.0}) for s in range(1, 601)]
    picks = [sample(logits, [Request("r", [1], p, seed=p.seed)])[0] for p in params]
    expected = math.exp(4) / (1 + math.exp(4))
    assert abs(sum(picks) / len(picks) - expected) < 0.03
