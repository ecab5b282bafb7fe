"""The acceptance rule samples the target's distribution: chi-square over a 6-token vocabulary with
fixed seeds, for n-gram proposals (a point mass) and draft-model ones (a distribution q), on the
first token and on the second given the first proposal stood. The same bound rejects the rule with
its correction dropped (a rejected proposal redrawn from p instead of norm(max(0, p - q)))."""
from __future__ import annotations

import torch

from engine.sampling.params import SamplingParams
from engine.sampling.sampler import seeded_draw, seeded_uniform
from engine.scheduling.request import Request
from engine.spec.verify import accept, rejection_sample

NUM_DRAWS = 3000
CHI2_BOUND = 20.5          # chi-square, 5 degrees of freedom, p = 0.001
LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0, -1.0],
                       [0.1, 1.2, 0.3, -0.4, 0.6, 0.0],
                       [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
DRAFTS = [3, 4]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _drafts(seed: int, draft_probs) -> list[int]:
    """The proposals: fixed (n-gram: q is a point mass on them), or drawn from q with a seed of their own."""
    if draft_probs is None:
        return list(DRAFTS)
    return [seeded_draw(q, seed + NUM_DRAWS, j) for j, q in enumerate(draft_probs)]


def _request(seed: int, draft_probs=None) -> Request:
    req = Request("r", [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=16), seed)
    req.spec_token_ids = _drafts(seed, draft_probs)
    req.spec_draft_probs = draft_probs
    return req


def _counts(draw) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first token, and of the second where the first proposal stood."""
    first, second = torch.zeros(6), torch.zeros(6)
    for seed in range(NUM_DRAWS):
        tokens = draw(seed)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


def _check(draft_probs) -> None:
    p = torch.softmax(LOGITS, dim=-1)
    first, second = _counts(lambda seed: accept(LOGITS, _request(seed, draft_probs)))
    assert _chi2(first, p[0]) < CHI2_BOUND
    assert second.sum() > 300 and _chi2(second, p[1]) < CHI2_BOUND

    def uncorrected(seed: int) -> list[int]:       # the same rule, rejected proposals redrawn from p
        draft = _drafts(seed, draft_probs)[0]
        q = 1.0 if draft_probs is None else float(draft_probs[0, draft])
        if seeded_uniform(seed, 0) * q < float(p[0, draft]):
            return [draft, seeded_draw(p[1], seed, 1)]
        return [seeded_draw(p[0], seed, 0)]
    assert _chi2(_counts(uncorrected)[0], p[0]) > CHI2_BOUND


def test_ngram_point_mass_proposals_sample_the_target():
    _check(None)


def test_draft_distribution_proposals_sample_the_target():
    q = torch.softmax(torch.tensor([[0.0, 0.0, 0.0, 1.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0, 0.5]]), dim=-1)
    _check(q)


def test_greedy_accepts_the_argmax_prefix_and_adds_the_target_token():
    req = Request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=16), 0)
    req.spec_token_ids = [0, 1]                     # both the argmax of their rows: row 2 adds one more
    assert accept(LOGITS, req) == [0, 1, 0]
    req.spec_token_ids = [0, 5]                     # the second is wrong: replaced by row 1's argmax
    assert accept(LOGITS, req) == [0, 1]
    assert req.output_token_ids == []               # judged as decoded, left unchanged


def test_rejection_sample_without_a_proposal_is_the_plain_seeded_draw():
    p = torch.softmax(LOGITS[0], dim=-1)
    assert [rejection_sample(p, None, None, s, 7) for s in range(50)] == [seeded_draw(p, s, 7) for s in range(50)]
