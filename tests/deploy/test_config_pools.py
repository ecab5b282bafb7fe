"""The pools section: threads and count bounds (deploy/config/pools.py)."""
from __future__ import annotations

from deploy.config import load_config


def test_resources_threads_and_bounds():
    config = load_config(None, {"pools.decode.resources.num_cpus": 2.5,
                                "pools.prefill.resources.torch_threads": 3})
    assert config.pools.decode.resources.threads() == 2
    assert config.pools.prefill.resources.threads() == 3
    assert config.pools.prefill.bounds() == (1, 1) and not config.pools.prefill.is_auto
