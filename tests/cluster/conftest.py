from __future__ import annotations

import pytest

from engine import Engine


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """Colocated Engine outputs: the bit-exact reference."""
    engine = Engine(tiny_model_dir, dtype="float32", num_blocks=1024)

    def run(prompts, params):
        return [c.token_ids for c in engine.generate(prompts, params)]
    return run


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from deploy.launcher import init_ray
    init_ray(num_cpus=8)
    yield
    ray.shutdown()
