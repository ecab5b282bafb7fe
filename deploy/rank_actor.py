"""A tensor-parallel rank other than 0 of a serving actor (`pools.<pool>.tensor_parallel` above 1).

The serving actor (deploy/actor.py) is rank 0: it schedules, samples and talks to the router. Each other
rank is one `RankActor` in the same Ray placement group: it builds the same engine on its shard (joining
rank 0's group as the engines are built, all at once) and then, in `follow`, runs rank 0's step plans until
rank 0 closes the group. When rank 0 dies, `follow` fails and the process ends, so the whole group is gone
and the pool manager starts a fresh one; when this rank dies, rank 0's next step fails and rank 0 ends
likewise (engine/scheduling/loop.py). Either way the router retries or migrates the requests as for any
dead actor.
"""
from __future__ import annotations

import faulthandler
import logging
import os

from engine import Engine, EngineArgs

log = logging.getLogger(f"pdserve.{__name__}")
EXIT_RANK_0_LOST = 71


class RankActor:
    def __init__(self, engine_args: EngineArgs, actor_id: str):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        faulthandler.enable()
        self.actor_id, self.rank = actor_id, engine_args.tensor_parallel_rank
        self.engine = Engine(engine_args)
        log.info("actor %s: tensor-parallel rank %d of %d ready", actor_id, self.rank, engine_args.tensor_parallel)

    def follow(self) -> None:
        """Run rank 0's step plans until it closes the group; end the process if rank 0 is lost."""
        try:
            self.engine.follow()
        except Exception as e:         # rank 0 (or the group) is gone: this rank can serve nobody
            log.error("actor %s: tensor-parallel rank %d lost rank 0 (%s); exiting", self.actor_id, self.rank, e)
            os._exit(EXIT_RANK_0_LOST)
