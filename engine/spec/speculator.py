"""The engine's speculation: proposals before each step, verification counts after it.

Lifecycle of one decoding sequence's step: `propose` sets its `spec_token_ids` (k from the
turn-down, capped by what its max_tokens leaves); the scheduler fits as many as its budget takes;
the runner computes them after the sequence's last token; the engine `accept`s a prefix
(engine/spec/verify.py) and the scheduler `settle`s the KV (rejected tokens' blocks freed).
Prefill-only sequences are never proposed for. A sequence with a grammar (structured output) is:
verification judges each row under the grammar's mask after the tokens before it, so a proposal the
grammar refuses has probability 0 and is rejected, and the matcher only ever consumes kept tokens.
Proposals come from the sequence's own tokens (`ngram`) or from a draft model (`draft`,
engine/spec/draft.py), which also holds KV blocks per sequence until `release`; or, given a `proposer`,
from that (the simulator's stand-in for the method's, bench/simulate/sim_spec.py): everything else above
runs as it does for the method's own proposals.
"""
from __future__ import annotations

from engine.scheduling.request import Request, RequestStatus
from engine.spec.draft import DraftModel
from engine.spec.config import SpecConfig
from engine.spec.ngram import NgramIndex
from engine.spec.turn_down import TurnDown


class Speculator:
    def __init__(self, config: SpecConfig, draft: DraftModel | None = None, proposer: object | None = None):
        """draft: the draft model (method `draft`). proposer: proposes in place of the method's own n-gram
        lookup or draft; anything with DraftModel's `propose(seqs, rooms)` and `release(req)`."""
        config.validate()
        assert proposer is not None or (config.method == "draft") == (draft is not None)
        self.config = config
        self.draft = draft
        self.proposer = proposer if proposer is not None else draft     # None: the n-gram lookup
        self.turn_down = TurnDown(config.k, config.adaptive)
        self.num_proposed = 0        # draft tokens verified, over the engine's life
        self.num_accepted = 0        # of those, accepted
        self.num_steps_off = 0       # steps with sequences decoding where the turn-down chose k = 0

    @staticmethod
    def decoding(req: Request) -> bool:
        """Whether `req` decodes this step (its only pending token is the one it sampled last)."""
        return (req.status is RequestStatus.RUNNING and not req.prefill_only
                and req.output_token_ids and req.num_computed_tokens == req.num_tokens - 1)

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` on each decoding sequence of `running`."""
        seqs = [r for r in running if self.decoding(r)]
        k = self.turn_down.num_tokens(len(seqs))
        if seqs and k == 0:
            self.num_steps_off += 1
        cfg = self.config
        rooms = [min(k, req.params.max_tokens - len(req.output_token_ids) - 1) for req in seqs]  # +1 per step
        if self.proposer is not None:
            self.proposer.propose(seqs, rooms)
            return
        for req, room in zip(seqs, rooms):
            if req.spec_state is None:
                req.spec_state = NgramIndex(cfg.ngram_min, cfg.ngram_max)
            req.spec_token_ids = req.spec_state.propose(req.all_token_ids, room)

    def release(self, req: Request) -> None:
        """The sequence ended: what the proposer holds for it goes back."""
        if self.proposer is not None:
            self.proposer.release(req)

    def verified(self, req: Request, num_proposed: int, num_accepted: int) -> None:
        req.num_spec_proposed += num_proposed
        req.num_spec_accepted += num_accepted
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.turn_down.observe_verified(num_proposed, num_accepted)
