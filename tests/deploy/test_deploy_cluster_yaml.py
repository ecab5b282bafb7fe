"""Every shipped `ray up` config passes Ray's own checks, the way `ray up`
runs them: prepare_config (merge the provider's defaults) then
validate_config (ray-schema.json + node-type checks). Nothing is launched."""
from __future__ import annotations

import copy
import glob
import json
import os
import subprocess

import pytest
import yaml

from deploy.config import DEFAULT_CONFIG_PATH

util = pytest.importorskip("ray.autoscaler._private.util")
jsonschema = pytest.importorskip("jsonschema")  # what validate_config uses

DEPLOY_DIR = os.path.dirname(DEFAULT_CONFIG_PATH)
CLUSTER_YAMLS = sorted(glob.glob(os.path.join(DEPLOY_DIR, "cluster*.yaml")))


def ray_check(config: dict) -> dict:
    """What `ray up` does before it touches a cloud or a machine."""
    prepared = util.prepare_config(copy.deepcopy(config))
    util.validate_config(prepared)
    return prepared


def load(path: str) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def test_both_cluster_yamls_are_shipped():
    names = {os.path.basename(p) for p in CLUSTER_YAMLS}
    assert {"cluster.yaml", "cluster-local.yaml"} <= names


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=os.path.basename)
def test_cluster_yaml_passes_ray_validation(path):
    prepared = ray_check(load(path))
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=os.path.basename)
@pytest.mark.parametrize("breakage", ["unknown-top-key", "commands-not-a-list",
                                      "node-type-typo", "wrong-type"])
def test_broken_copy_fails_ray_validation(path, breakage):
    config = load(path)
    if breakage == "unknown-top-key":
        config["head_start_ray_command"] = ["ray start --head"]  # typo of ..._commands
    elif breakage == "commands-not-a-list":
        config["worker_start_ray_commands"] = "ray start --address=$RAY_HEAD_IP:6379"
    elif breakage == "node-type-typo":
        if "available_node_types" not in config:
            pytest.skip("the local provider defines its node type itself")
        next(iter(config["available_node_types"].values()))["min_worker"] = 1
    else:
        config["idle_timeout_minutes"] = "ten"
    with pytest.raises(jsonschema.ValidationError):
        ray_check(config)


def test_schema_file_is_the_one_ray_ships():
    import ray.autoscaler
    schema = os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")
    with open(schema) as f:
        assert "available_node_types" in json.load(f)["properties"]


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=os.path.basename)
def test_head_serves_pdserve_and_commands_parse(path):
    config = load(path)
    head = " ".join(config["head_start_ray_commands"])
    assert "pdserve serve --address auto --config ~/pdserve/pools.yaml" in head
    assert "~/pdserve/pools.yaml" in config["file_mounts"]
    setup = " ".join(config["setup_commands"])
    assert "torch==2.13.0" in setup and "pdserve" in setup
    commands = (config["setup_commands"] + config["head_start_ray_commands"]
                + config["worker_start_ray_commands"])
    for command in commands:
        result = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert result.returncode == 0, (command, result.stderr)


def test_cloud_node_types_carry_pool_resources():
    config = load(os.path.join(DEPLOY_DIR, "cluster.yaml"))
    resources = {name: spec.get("resources", {})
                 for name, spec in config["available_node_types"].items()}
    assert resources["prefill_gpu"] == {"prefill_node": 4}
    assert resources["decode_gpu"] == {"decode_node": 4}
    assert resources[config["head_node_type"]] == {}


@pytest.mark.parametrize("ips, expected", [
    ("10.0.0.5 192.0.2.11", '{"prefill_node": 4}'),
    ("192.0.2.12", '{"decode_node": 4}'),
    ("192.0.2.111", "{}"),
])
def test_local_workers_pick_resources_from_their_ip(tmp_path, ips, expected):
    config = load(os.path.join(DEPLOY_DIR, "cluster-local.yaml"))
    start = config["worker_start_ray_commands"][-1]
    assert "ray start" in start
    probe = start[: start.index("ulimit")] + 'printf %s "$RES"'
    fake = tmp_path / "hostname"
    fake.write_text(f"#!/bin/sh\necho '{ips} '\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    result = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, env=env)
    assert result.stdout == expected, result.stderr


def test_placement_example_fits_the_cloud_node_types(monkeypatch):
    """Each pool of examples/placement.yaml finds a node type with its custom
    resource, and the node types' max_workers hold every pool at its max."""
    from deploy.config import load_config
    monkeypatch.setenv("PDSERVE_TOKEN", "t")
    pools = load_config(os.path.join(DEPLOY_DIR, "examples", "placement.yaml")).pools
    node_types = load(os.path.join(DEPLOY_DIR, "cluster.yaml"))["available_node_types"]
    demand: dict[str, float] = {}
    for _, pool in pools.items():
        (resource, amount), = pool.resources.custom.items()
        demand[resource] = demand.get(resource, 0) + amount * pool.bounds()[1]
    for resource, needed in demand.items():
        supply = sum(spec.get("resources", {}).get(resource, 0) * spec.get("max_workers", 0)
                     for spec in node_types.values())
        assert supply >= needed, (resource, supply, needed)
