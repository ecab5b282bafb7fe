"""Helpers of the kv_transfer tests (a module of its own: `conftest` is not a safe import name
when several test folders run together)."""

from __future__ import annotations

import time

import torch

from kv_transfer import FakeHub, KVLayout, SimpleBlockPool, make_receiver, make_sender

TOKEN = "test-cluster-token"


def random_cache(layout: KVLayout, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """kv_cache: [num_layers, num_blocks, 2, H, B, D] with distinct random values."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layout.cache_shape(num_blocks), generator=generator).to(layout.dtype)


def wait_for(predicate, timeout=10.0) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def assert_no_leak(pool: SimpleBlockPool, owned: list[int] = ()) -> None:
    """Every reserved block came back, except those a DONE transfer handed over."""
    assert pool.used_ids == set(owned), f"leaked blocks: {sorted(pool.used_ids - set(owned))}"


class Pair:
    """One sender and one receiver of the same transport over a fresh pool."""

    def __init__(self, kind, layout, *, codec="none", num_dst_blocks=64, sender_token=TOKEN, receiver_layout=None,
                 hub=None, receiver_options=None, **sender_kwargs):
        self.kind, self.layout = kind, layout
        self.pool = SimpleBlockPool(num_dst_blocks)
        receiver_layout = receiver_layout or layout
        self.dst_cache = torch.zeros(receiver_layout.cache_shape(num_dst_blocks), dtype=receiver_layout.dtype)
        extra = {"hub": hub or FakeHub()} if kind == "fake" else {}
        self.receiver = make_receiver(kind, receiver_layout, self.dst_cache, self.pool, codec=codec, token=TOKEN,
                                      **extra, **(receiver_options or {}))
        self.sender = make_sender(kind, layout, codec=codec, token=sender_token, **extra, **sender_kwargs)
        self.dest = self.receiver.endpoint

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
