"""Shared helpers of the cluster tests."""
from __future__ import annotations

from cluster_support import ClusterThread  # noqa: F401  (re-exported for the cluster tests)
from worker_support import prompts_and_params  # noqa: F401  (re-exported for the cluster tests)


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
                   n_decode: int = 1, attention: str = "auto", extra: dict | None = None, **routing):
    """A tiny local cluster's config; `routing` keys go under routing., `extra` takes full dotted keys."""
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
    overrides.update(extra or {})
    return load_config(None, overrides)


def start_greedy_streams(address: str, prompts: list[list[int]], max_tokens: int):
    """One thread per prompt streaming a greedy, EOS-ignoring request: (threads, {index: tokens}); a request
    that fails leaves its index out."""
    import threading

    from router.client import generate
    results: dict[int, list[int]] = {}

    def run(i):
        tokens = []
        for msg in generate(address, token_ids=prompts[i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            timeout=90):
            tokens += msg.token_ids
        results[i] = tokens
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, results


def join_streams(threads, limit: float = 120.0) -> None:
    """Every stream thread ended within `limit` seconds in all."""
    import time
    end = time.monotonic() + limit
    for t in threads:
        t.join(max(end - time.monotonic(), 0))
    assert not any(t.is_alive() for t in threads), "a request hung"
