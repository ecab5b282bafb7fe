"""Speculative decoding in the simulator: the engine's own speculation, with only the proposer replaced.

A simulated actor whose config turns `speculative:` on runs the engine's `Speculator` (k per step from
the real `TurnDown`, capped by each sequence's max_tokens), the real `Scheduler` scheduling 1 + k tokens
per verifying sequence and rolling the rejected ones' KV back (`settle`), and `Engine.step`'s verifying
branch. Two things are stand-ins, as the forward pass and the sampler are:

- the proposer (`SimProposer`): proposal j of a sequence is the token the simulated target will produce
  at that position (`SimEngine.target_token`) with probability α, the per-token acceptance, and another
  token otherwise; whether position p's proposal is right is a seeded draw of (sequence seed, p), so a
  run is reproducible for its seed, and a step accepts a run of i.i.d. Bernoulli(α) successes: the law
  `engine/spec/tokens_per_step.py` models, (1 − α^(k+1)) / (1 − α) tokens per step;
- verification (`SimEngine.accepted_tokens`): the proposals that equal the target's tokens, then the
  target's own next one.

α comes from the acceptance *ratio* the engine reports (accepted / proposed at k proposals per step):
`--spec-acceptance A`, else the acceptance a measured profile holds for the method (`pdserve profile`),
converted with `per_token_acceptance` (`engine.performance.Speculation`). With neither the run is
refused: a simulator that guessed would print a speed-up nobody measured.
"""
from __future__ import annotations

from collections.abc import Callable

from deploy.config import PDServeConfig
from deploy.performance import configured_acceptance, draft_cost_of
from engine.model.config import ModelConfig
from engine.performance import Speculation
from engine.scheduling.request import Request

_MASK = (1 << 64) - 1
_SALT = 0x2545F4914F6CDD1D


def right_at(seed: int, position: int, alpha: float) -> bool:
    """Whether the proposal at output `position` of the sequence with `seed` is the target's token:
    a splitmix64 draw of (seed, position), true with probability `alpha`."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + _SALT) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) < alpha * (1 << 64)


class SimProposer:
    """The `Speculator`'s proposer on a simulated actor (DraftModel's interface: `propose`, `release`).

    target(seq, position): the token the simulated target produces at output `position` of `seq`;
    wrong(token): a token other than `token`."""

    def __init__(self, alpha: float, target: Callable[[Request, int], int], wrong: Callable[[int], int]):
        self.alpha = alpha
        self.target = target
        self.wrong = wrong

    def propose(self, seqs: list[Request], rooms: list[int]) -> None:
        alpha, target, wrong = self.alpha, self.target, self.wrong
        for req, room in zip(seqs, rooms):
            first = len(req.output_token_ids)
            proposals = []
            for position in range(first, first + max(room, 0)):
                token = target(req, position)
                proposals.append(token if right_at(req.seed, position, alpha) else wrong(token))
            req.spec_token_ids, req.spec_draft_probs = proposals, None

    def release(self, req: Request) -> None:
        """Nothing is held per sequence."""


def speculation_for(cfg: PDServeConfig, shape: ModelConfig, profile: dict | None = None,
                    acceptance: float | None = None) -> Speculation | None:
    """The config's speculative decoding as the simulated actors run it; None with `speculative.method` off.

    acceptance: accepted / proposed tokens at k proposals per step (`--spec-acceptance`); None: the
    measured `profile`'s for the method. ValueError, naming what to give, when neither has one, or
    when the draft's shape cannot be read (its cost is the weight bytes it reads per forward)."""
    s = cfg.speculative
    if s.method == "off":
        return None
    k = s.engine_config().k
    acceptance = configured_acceptance(cfg, profile, acceptance)
    if acceptance is None:
        raise ValueError(f"speculative.method {s.method}: the simulator needs the proposals' acceptance rate: pass "
                         f"--spec-acceptance A (accepted / proposed tokens at k = {k} proposals per step, as "
                         "`pdserve bench spec` and pdserve_spec_acceptance_ratio report it), or --profile a "
                         "profile that measured it (`pdserve profile` with speculation on)")
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"--spec-acceptance {acceptance:g}: an acceptance rate is accepted / proposed tokens, "
                         "between 0 and 1")
    return Speculation(s.method, k, acceptance, s.adaptive, draft_cost(cfg, shape) if s.method == "draft" else 0.0)


def draft_cost(cfg: PDServeConfig, shape: ModelConfig) -> float:
    """`deploy.performance.draft_cost_of` the config's draft model, its shape read as `--model` is, and
    `shape`."""
    from bench.simulate.models import model_config
    name = cfg.speculative.draft.model
    try:
        draft = model_config(name)
    except ValueError as e:
        raise ValueError(f"speculative.draft.model: {e}") from None
    return draft_cost_of(draft, shape)


def describe_speculation(spec: Speculation) -> str:
    """"ngram, k = 4 (adaptive), acceptance 0.60 (per token 0.71)" for the report."""
    how = "adaptive" if spec.adaptive else "fixed"
    cost = f", draft forward {spec.draft_cost:.3g}× a step" if spec.method == "draft" else ""
    return (f"{spec.method}, k = {spec.num_tokens} ({how}), acceptance {spec.acceptance:.2f} "
            f"(per token {spec.alpha:.2f}){cost}")
