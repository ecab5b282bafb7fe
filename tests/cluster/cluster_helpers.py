"""Shared helpers of the cluster tests."""
from __future__ import annotations

from cluster_support import ClusterThread  # noqa: F401  (re-exported for the cluster tests)

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


def wait_blocks_free(address: str, timeout: float = 10.0):
    """GetStats until every actor reports zero used KV blocks; returns the last response."""
    import time

    from router.client import get_stats
    end = time.monotonic() + timeout
    while True:
        stats = get_stats(address, timeout=5)
        if all(a.kv_blocks_used == 0 for a in stats.actors) or time.monotonic() > end:
            return stats
        time.sleep(0.1)


def cluster_config(model_dir: str, transport: str = "grpc", codec: str = "none", n_prefill: int = 1,
                   n_decode: int = 1, attention: str = "auto", **routing):
    from deploy.config import load_config
    overrides = {
        "model.name": model_dir, "model.dtype": "float32",
        "pools.prefill.count": n_prefill, "pools.decode.count": n_decode,
        "pools.prefill.resources.num_cpus": 0.5, "pools.decode.resources.num_cpus": 0.5,
        "pools.prefill.resources.torch_threads": 1, "pools.decode.resources.torch_threads": 1,
        "kv_cache.num_blocks": 512, "kv_transfer.transport": transport, "kv_transfer.compression": codec,
        "model.attention": attention,
    }
    overrides.update({f"routing.{k}": v for k, v in routing.items()})
    return load_config(None, overrides)
