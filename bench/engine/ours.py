"""How the engine benchmarks time our engine: random prompts, one prefill, a pure decode batch."""
from __future__ import annotations

import os
import random
import time

from bench.engine import peers
from engine import Engine, SamplingParams


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(length)]     # 0, 1 are <s>, </s>


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def ours_prefill(engine: Engine, prompt: list[int]) -> float:
    return peers.timed(lambda: engine.generate([prompt], greedy(1)))


class OursDecoder:
    """B requests prefilled once; `steps(n)` times n `Engine.step()` calls of the pure decode batch."""

    def __init__(self, engine: Engine, prompts: list[list[int]], max_tokens: int):
        self.engine = engine
        self.ids = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
        self.reqs = [engine.requests[i] for i in self.ids]
        while any(not r.output_token_ids for r in self.reqs):      # prefill (maybe several steps)
            engine.step()

    def steps(self, num_steps: int) -> float:
        before = sum(len(r.output_token_ids) for r in self.reqs)
        start = time.perf_counter()
        for _ in range(num_steps):
            self.engine.step()
        elapsed = time.perf_counter() - start
        made = sum(len(r.output_token_ids) for r in self.reqs) - before
        assert made == num_steps * len(self.reqs), (
            f"not a pure decode batch: {made} tokens in {num_steps} steps of {len(self.reqs)} sequences "
            f"({sorted({r.status.name for r in self.reqs})}, {self.engine.block_manager.num_free_blocks} free blocks)")
        return elapsed / num_steps

    def close(self) -> None:
        for i in self.ids:
            self.engine.abort(i)
