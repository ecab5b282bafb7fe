"""Fitting pool actors onto a local Ray instance (deploy/placement.py): the CPU fraction and its rounding,
what one actor asks, and the launcher's count of the most actors per pool (no Ray needed)."""
from __future__ import annotations

import pytest

from deploy.config import load_config
from deploy.launcher import ActorFactory, asked_resources
from deploy.placement import cpu_scale, scaled_cpus


@pytest.mark.parametrize("asked,node,scale", [(3.0, 2.0, 2 / 3), (2.0, 2.0, 1.0), (1.0, 8.0, 1.0), (4.0, 0.0, 1.0)])
def test_cpu_scale(asked, node, scale):
    assert cpu_scale(asked, node) == pytest.approx(scale)


def test_scaled_cpus_round_down_to_rays_step_and_fit():
    fraction = cpu_scale(3.0, 2.0)
    assert scaled_cpus(1.0, fraction) == 0.6666
    assert 3 * scaled_cpus(1.0, fraction) <= 2.0
    assert scaled_cpus(1.0, 1.0) == 1.0 and scaled_cpus(2.5, 1.0) == 2.5
    assert scaled_cpus(1.0, 1e-9) == 0.0001          # never 0: Ray would treat it as "no CPU"
    assert 7 * scaled_cpus(0.5, cpu_scale(3.5, 3.0)) <= 3.0


def test_asked_resources_name_what_ray_sees(model_dir):
    cfg = load_config(None, {"model.name": model_dir, "pools.decode.resources.num_gpus": 0.5,
                             "pools.decode.resources.custom": {"decode_node": 1}})
    assert asked_resources(cfg, "decode") == {"CPU": 1.0, "GPU": 0.5, "decode_node": 1.0}
    assert asked_resources(cfg, "prefill") == {"CPU": 1.0}


def test_most_actors_counts_auto_pools_at_their_max_and_colocated_as_decode(model_dir):
    cfg = load_config(None, {"model.name": model_dir, "pools.prefill.count": 1, "pools.decode.count": "auto",
                             "pools.decode.min": 1, "pools.decode.max": 4})
    assert ActorFactory(cfg, "t").most_actors() == {"prefill": 1, "decode": 4}
    assert ActorFactory(cfg, "t").most_actors({"decode": 6}) == {"prefill": 1, "decode": 6}
    assert ActorFactory(cfg, "t", mode="colocated").most_actors() == {"decode": 5}
