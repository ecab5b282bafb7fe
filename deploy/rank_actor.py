"""A tensor-parallel rank other than 0 of a serving actor (`pools.<pool>.tensor_parallel` above 1).

The serving actor (deploy/actor.py) is rank 0: it schedules, samples and talks to the router. Each other
rank is one `RankActor` in the same Ray placement group: it builds the same engine on its shard (joining
rank 0's group as the engines are built, all at once) and then, in `follow`, runs rank 0's step plans until
rank 0 closes the group. When rank 0 dies, `follow` fails and the process ends, so the whole group is gone
and the pool manager starts a fresh one; when this rank dies, rank 0's next step fails and rank 0 ends
likewise (engine/scheduling/loop.py). Either way the router retries or migrates the requests as for any
dead actor. Between steps, on other threads of the actor, rank 0 has it receive and send the KV copies of
its heads (deploy/rank_kv.py).
"""
from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os

from deploy.rank_kv import RankTransfers
from engine import Engine, EngineArgs

log = logging.getLogger(f"pdserve.{__name__}")
EXIT_RANK_0_LOST = 71


class RankActor:
    def __init__(self, engine_args: EngineArgs, actor_id: str):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        faulthandler.enable()
        self.actor_id, self.rank = actor_id, engine_args.tensor_parallel_rank
        self.engine = Engine(engine_args)
        self.transfers = RankTransfers(self.engine.kv_cache, self.engine.device)
        log.info("actor %s: tensor-parallel rank %d of %d ready", actor_id, self.rank, engine_args.tensor_parallel)

    # ---- KV copies of this rank's heads (deploy/rank_kv.py), asked by rank 0 while this rank follows ----
    def open_copy(self, key: str, transfer, layout, heads: range, rank0) -> str:
        """Open a receiver of one head copy over this rank's cache; returns its endpoint."""
        return self.transfers.open_receiver(key, transfer, layout, heads, rank0)

    def copy_status(self, key: str, transfer_id: str) -> str | None:
        status = self.transfers.receivers[key].status(transfer_id)
        return None if status is None else status.value

    def cancel_copy(self, key: str, transfer_id: str | None, request_id: str | None) -> None:
        self.transfers.receivers[key].cancel(transfer_id, request_id)

    def copy_stats(self, key: str) -> dict:
        return dataclasses.asdict(self.transfers.receivers[key].stats)

    def close_copies(self) -> None:
        self.transfers.close()

    def send_copy(self, transfer, layout, heads: range, piece: dict, dest: str) -> tuple:
        """Send one piece's head copy from this rank's cache; returns (status, error, failed side, wire bytes)."""
        return self.transfers.send(transfer, layout, heads, piece, dest)

    def follow(self) -> None:
        """Run rank 0's step plans until it closes the group; end the process if rank 0 is lost."""
        try:
            self.engine.follow()
        except Exception as e:         # rank 0 (or the group) is gone: this rank can serve nobody
            log.error("actor %s: tensor-parallel rank %d lost rank 0 (%s); exiting", self.actor_id, self.rank, e)
            os._exit(EXIT_RANK_0_LOST)
