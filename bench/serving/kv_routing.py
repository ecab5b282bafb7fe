"""KV-aware routing: the prefix hit rate with the router's event-fed index, beside an oracle's.

    python -m bench.serving.kv_routing [--model tiny] [--workloads shared-prefix,multi-turn]
                                       [--concurrency 4] [--seed 0] [--json FILE]

2 prefill + 2 decode workers (real engines in this process, the fake KV transport, the router's
own `Dispatcher` and policies) serve each workload, from cold caches, `--repeats` times each way:

    index   placement asks the router's `KVIndex`, fed only by the actors' cache events
            (router.placement.kv_event_poller: a pull every `--interval` s + a poke per finished prefill)
    oracle  placement asks the engines' own caches at the moment of dispatch (`OracleIndex`)
    blind   placement asks an index that hears nothing (load only: what the events buy)

Two figures, both over prompt tokens:

    at dispatch (one run, the same placements and loads): in the index run, each prefill choice is
        also made by the same policy over the engines' caches read at that instant; the prompt
        tokens those caches hold on the index's choice vs on the oracle's choice. Index / oracle
        here is the index's own quality (timing noise cancels: both see one trajectory).
    achieved (separate runs): the engines' own `num_cached_tokens` of the index run vs of a run
        placed by the oracle (noisier: placement under load depends on timing).

After each run the index is checked against every engine's cache (equal sets).
Workloads (generated here, deterministic per seed):

    shared-prefix  6 system prompts of 384 tokens, each request one of them + a 24-40-token question
    multi-turn     12 conversations of 4 turns; turn t+1's prompt = turn t's prompt + its answer + a new
                   32-token message (the answer's blocks are on the decode actor; the prefill actor
                   hits on the previous prompt)

Each prefill engine holds 160 blocks of 16 tokens: one actor cannot cache a whole workload,
two can, so where a prompt goes decides whether it hits.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass

from bench.serving.local_actors import LocalCluster, start_local_cluster
from engine.sampling.params import SamplingParams
from router.backend import GenerationInput
from router.dispatcher import Dispatcher
from router.placement import KVIndex, Placer
from router.placement.policies import pick_prefill, usable_cached_tokens
from router.routing import RoutingSettings

BLOCK_SIZE = 16
PREFILL_BLOCKS, DECODE_BLOCKS = 160, 256
WORKLOADS = ("shared-prefix", "multi-turn")
TOKEN_IDS = (2, 1000)


@dataclass(slots=True)
class Conversation:
    """User messages, one per turn: turn 0's prompt is messages[0]; turn t's is turn t-1's prompt +
    its answer + messages[t]."""

    messages: list[list[int]]
    output_len: int


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_IDS) for _ in range(n)]


def shared_prefix(rng: random.Random, num_systems: int = 6, system_len: int = 384, num_requests: int = 48,
                  output_len: int = 8) -> list[Conversation]:
    systems = [_tokens(rng, system_len) for _ in range(num_systems)]
    return [Conversation([rng.choice(systems) + _tokens(rng, rng.randint(24, 40))], output_len)
            for _ in range(num_requests)]


def multi_turn(rng: random.Random, num_conversations: int = 12, num_turns: int = 4, opener_len: int = 160,
               message_len: int = 32, output_len: int = 16) -> list[Conversation]:
    return [Conversation([_tokens(rng, opener_len)] + [_tokens(rng, message_len) for _ in range(num_turns - 1)],
                         output_len) for _ in range(num_conversations)]


def make_workload(name: str, seed: int) -> list[Conversation]:
    rng = random.Random(f"{name}-{seed}")
    if name == "shared-prefix":
        return shared_prefix(rng)
    if name == "multi-turn":
        return multi_turn(rng)
    raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")


class OracleIndex:
    """The engines' own prefix caches, read when asked: what a perfect index would answer."""

    def __init__(self, cluster: LocalCluster):
        self.block_managers = {w.actor_id: w.engine.block_manager for w in cluster.workers}

    def prefix_by_actor(self, hashes: list[bytes]) -> dict[str, int]:
        out = {}
        for actor_id, bm in self.block_managers.items():
            with bm.lock:
                n = len(bm.match_prefix(hashes))
            if n:
                out[actor_id] = n
        return out

    def onboard_cost(self, actor_id: str, hashes: list[bytes], num_blocks: int) -> float:
        """Nothing to onboard: the prefix it reports is in the paged cache (these engines have no tiers)."""
        return 0.0


class AuditedPlacer(Placer):
    """Makes every prefill choice twice: over its index (used) and over the oracle (recorded)."""

    oracle: OracleIndex
    chosen_tokens = 0          # prompt tokens cached, at dispatch, on the actor the index chose
    oracle_tokens = 0          # ... on the actor the oracle would have chosen
    dispatches = 0

    def pick_prefill(self, hashes, num_prompt_tokens, excluded):
        view, cached = super().pick_prefill(hashes, num_prompt_tokens, excluded)
        if view is not None:
            truth = self.oracle.prefix_by_actor(hashes)
            best, _ = pick_prefill(self.pools.prefill, hashes, num_prompt_tokens, self.block_size, self.oracle,
                                   excluded, self.routing.prefill_policy)
            self.dispatches += 1
            self.chosen_tokens += usable_cached_tokens(truth.get(view.actor_id, 0), num_prompt_tokens,
                                                       self.block_size)
            self.oracle_tokens += usable_cached_tokens(truth.get(best.actor_id, 0), num_prompt_tokens,
                                                       self.block_size)
        return view, cached


@dataclass
class RunResult:
    workload: str
    placement: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    index_equals_caches: bool = False
    resyncs: int = 0
    polls: int = 0
    dispatch_chosen_tokens: int = 0      # AuditedPlacer's counts (index runs)
    dispatch_oracle_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


async def run_once(conversations: list[Conversation], workload: str, placement: str, model: str,
                   concurrency: int, interval_s: float) -> RunResult:
    cluster = start_local_cluster(model, 2, 2, PREFILL_BLOCKS, DECODE_BLOCKS, BLOCK_SIZE)
    d = Dispatcher(cluster.pools, tokenizer=None, max_model_len=2048, block_size=BLOCK_SIZE,
                   routing=RoutingSettings(max_queue=256, kv_events_interval_s=interval_s))
    placer = d.placer = AuditedPlacer(d.pools, d.routing, d.block_size, d.kv_index, d.live, d.metrics)
    placer.oracle = OracleIndex(cluster)
    if placement == "oracle":
        placer.kv_index = placer.oracle           # the poller still feeds the dispatcher's KVIndex (checked below)
    elif placement == "blind":
        placer.kv_index = KVIndex()               # never fed
    poller = asyncio.get_running_loop().create_task(d.kv_poller.run())
    result = RunResult(workload, placement)
    queue: asyncio.Queue[tuple[int, Conversation]] = asyncio.Queue()
    for item in enumerate(conversations):
        queue.put_nowait(item)

    async def client() -> None:
        while not queue.empty():
            i, conv = queue.get_nowait()
            prompt: list[int] = []
            for t, message in enumerate(conv.messages):
                prompt = prompt + message
                params = SamplingParams(max_tokens=conv.output_len, temperature=0.0, ignore_eos=True)
                output: list[int] = []
                async for chunk in d.generate(GenerationInput(f"c{i}t{t}", list(prompt), params, None)):
                    output += chunk.token_ids
                result.requests += 1
                prompt = prompt + output
    start = time.monotonic()
    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
        result.seconds = time.monotonic() - start
        await asyncio.sleep(0.05)                  # the last requests' blocks are released on the loop threads
        # the engines' own counts (a usage's cached_prompt_tokens is 0 when the decode stream ends
        # before the PrefillResult arrives: the decode side does not know the prefill's hit)
        result.prompt_tokens = sum(v.client.num_prompt_tokens for v in cluster.pools.prefill)
        result.cached_tokens = sum(v.client.num_cached_tokens for v in cluster.pools.prefill)
        await d.kv_poller.sync_all()
        index = d.kv_poller.index
        result.index_equals_caches = all(index.hashes_of(w.actor_id) == set(w.engine.block_manager.cached)
                                         for w in cluster.workers)
        result.resyncs, result.polls = d.kv_poller.num_resyncs, d.kv_poller.num_polls
        result.dispatch_chosen_tokens, result.dispatch_oracle_tokens = placer.chosen_tokens, placer.oracle_tokens
    finally:
        poller.cancel()
        cluster.stop()
    return result


def table(rows: list[dict]) -> str:
    head = ("workload", "requests", "prompt tok", "at dispatch: index", "oracle", "index / oracle",
            "achieved: index", "oracle", "index / oracle", "blind", "index == caches", "resyncs")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join(str(x) for x in (
            r["workload"], r["requests"], r["prompt_tokens"], f"{r['dispatch_index_hit_rate']:.1%}",
            f"{r['dispatch_oracle_hit_rate']:.1%}", f"{r['dispatch_ratio']:.1%}", f"{r['index_hit_rate']:.1%}",
            f"{r['oracle_hit_rate']:.1%}", f"{r['ratio']:.1%}", f"{r['blind_hit_rate']:.1%}",
            r["index_equals_caches"], r["resyncs"])))
    return "\n".join(lines)


def _ratio(a: int, b: int) -> float:
    return a / b if b else 1.0


async def bench(workloads: list[str], model: str, concurrency: int, seed: int, repeats: int,
                interval_s: float) -> list[dict]:
    rows = []
    for name in workloads:
        runs: dict[str, list[RunResult]] = {"index": [], "oracle": [], "blind": []}
        for r in range(repeats):
            conversations = make_workload(name, seed + r)
            for placement in runs:
                res = await run_once(conversations, name, placement, model, concurrency, interval_s)
                runs[placement].append(res)
                print(f"{name} #{r} {placement}: hit rate {res.hit_rate:.1%}, at dispatch "
                      f"{res.dispatch_chosen_tokens}/{res.dispatch_oracle_tokens} tokens, {res.seconds:.1f}s",
                      file=sys.stderr)
        index, oracle, blind = runs["index"], runs["oracle"], runs["blind"]
        prompt = sum(x.prompt_tokens for x in index)
        chosen, best = sum(x.dispatch_chosen_tokens for x in index), sum(x.dispatch_oracle_tokens for x in index)
        hits, oracle_hits = sum(x.cached_tokens for x in index), sum(x.cached_tokens for x in oracle)
        rows.append({"workload": name, "requests": sum(x.requests for x in index), "prompt_tokens": prompt,
                     "dispatch_index_hit_rate": chosen / prompt, "dispatch_oracle_hit_rate": best / prompt,
                     "dispatch_ratio": _ratio(chosen, best),
                     "index_hit_rate": hits / prompt,
                     "oracle_hit_rate": oracle_hits / sum(x.prompt_tokens for x in oracle),
                     "ratio": _ratio(hits, oracle_hits),
                     "blind_hit_rate": sum(x.cached_tokens for x in blind) / sum(x.prompt_tokens for x in blind),
                     "index_equals_caches": all(x.index_equals_caches for x in index + oracle + blind),
                     "resyncs": sum(x.resyncs for x in index + oracle + blind),
                     "polls": sum(x.polls for x in index),
                     "index_s": round(sum(x.seconds for x in index), 2),
                     "oracle_s": round(sum(x.seconds for x in oracle), 2)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs each way (seeds seed, seed+1, ...)")
    parser.add_argument("--interval", type=float, default=RoutingSettings.kv_events_interval_s,
                        help="the KV event poller's period, s (routing.kv_events_interval_s)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad:
        parser.error(f"--workloads: unknown {', '.join(bad)}; choose from {', '.join(WORKLOADS)}")
    rows = asyncio.run(bench(names, args.model, args.concurrency, args.seed, args.repeats, args.interval))
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
