"""Shared helpers of the cluster tests."""
from __future__ import annotations

import threading

import torch

from engine import SamplingParams


def prompts_and_params(n: int, seed: int = 0, max_len: int = 500):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=g).tolist()
    prompts = [torch.randint(2, 1000, (length,), generator=g).tolist() for length in lengths]
    params = [SamplingParams(max_tokens=4 + (i * 5) % 24, temperature=0.0, ignore_eos=True) for i in range(n)]
    return prompts, params


class Collector:
    """Gathers streamed events per request, thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.events: dict[str, list] = {}
        self.done = threading.Event()
        self.expected = 0

    def __call__(self, event):
        with self.lock:
            self.events.setdefault(event.request_id, []).append(event)
            finished = sum(1 for evs in self.events.values() if evs[-1].finish_reason or evs[-1].error_code)
            if finished >= self.expected:
                self.done.set()
