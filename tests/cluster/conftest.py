from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from deploy.launcher import init_ray
    init_ray(num_cpus=8)
    yield
    ray.shutdown()
