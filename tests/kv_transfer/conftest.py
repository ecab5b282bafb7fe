"""Factories for kv_transfer tests: layouts, caches, sender/receiver pairs, leak checks."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["GLOO_SOCKET_IFNAME"] = "lo"

from kv_transfer import KVLayout  # noqa: E402

from kv_helpers import TOKEN, Pair, assert_no_leak, random_cache  # noqa: E402,F401


@pytest.fixture
def make_pair():
    pairs: list[Pair] = []

    def factory(kind, layout, **kwargs) -> Pair:
        if kind == "ray":
            _ensure_ray()
        pair = Pair(kind, layout, **kwargs)
        pairs.append(pair)
        return pair

    yield factory
    for pair in pairs:
        pair.close()


_RAY_STARTED = []


def _ensure_ray() -> None:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
        _RAY_STARTED.append(True)


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray():
    yield
    if _RAY_STARTED:
        import ray

        ray.shutdown()


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32,
                    model_fingerprint="tiny-test")
