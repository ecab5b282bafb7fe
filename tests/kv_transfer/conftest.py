"""Factories for kv_transfer tests: layouts, caches, sender/receiver pairs, leak checks."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["GLOO_SOCKET_IFNAME"] = "lo"

from kv_transfer import FakeHub, KVLayout, SimpleBlockPool, make_receiver, make_sender  # noqa: E402

TOKEN = "test-cluster-token"


def random_cache(layout: KVLayout, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """kv_cache: [num_layers, num_blocks, 2, H, B, D] with distinct random values."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layout.cache_shape(num_blocks), generator=generator).to(layout.dtype)


def assert_no_leak(pool: SimpleBlockPool, owned: list[int] = ()) -> None:
    """Every reserved block came back, except those a DONE transfer handed over."""
    assert pool.used_ids == set(owned), f"leaked blocks: {sorted(pool.used_ids - set(owned))}"


class Pair:
    """One sender and one receiver of the same transport over a fresh pool."""

    def __init__(self, kind, layout, *, codec="none", num_dst_blocks=64, sender_token=TOKEN, receiver_layout=None, hub=None, **sender_kwargs):
        self.kind, self.layout = kind, layout
        self.pool = SimpleBlockPool(num_dst_blocks)
        receiver_layout = receiver_layout or layout
        self.dst_cache = torch.zeros(receiver_layout.cache_shape(num_dst_blocks), dtype=receiver_layout.dtype)
        extra = {"hub": hub or FakeHub()} if kind == "fake" else {}
        self.receiver = make_receiver(kind, receiver_layout, self.dst_cache, self.pool, codec=codec, token=TOKEN, **extra)
        self.sender = make_sender(kind, layout, codec=codec, token=sender_token, **extra, **sender_kwargs)
        self.dest = self.receiver.endpoint

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


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
    return KVLayout(num_layers=3, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32, model_fingerprint="tiny-test")
