"""Multi-node placement: two simulated Ray nodes (custom resources `prefill_node`,
`decode_node`); prefill actors land on one and decode actors on the other, every listener is
on 127.0.0.1 (the torch transport's rendezvous listens on a socket bound to the host), and greedy output
equals the colocated Engine over the grpc and torch transports.

The cluster runs in a subprocess (multinode_main.py) so it never meets the session's local Ray.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from cluster_helpers import prompts_and_params

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


LOOPBACK = ("127.0.0.1:", "[::ffff:127.0.0.1]:")


@pytest.fixture(scope="module")
def multinode(tiny_model_dir, reference):
    prompts, params = prompts_and_params(8, seed=31, max_len=200)
    payload = json.dumps([{"ids": p, "max_tokens": prm.max_tokens} for p, prm in zip(prompts, params)])
    # A private Ray temp dir: the Cluster's address file (ray_current_cluster) and sessions stay
    # out of /tmp/ray, where another process's plain ray.init() would find and join them.
    ray_tmp = tempfile.mkdtemp(prefix="pdmn-", dir="/tmp")
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "multinode_main.py"), tiny_model_dir,
                               "grpc,torch"], input=payload, capture_output=True, text=True, timeout=240, env=env,
                              cwd=ROOT)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):]), reference(prompts, params)


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_prefill_and_decode_on_their_own_nodes(multinode, transport):
    report, expected = multinode
    nodes, run = report["nodes"], report["runs"][transport]
    assert nodes["prefill_node"] != nodes["decode_node"]
    assert run["placed"]["prefill"] == [nodes["prefill_node"]] * 2, (run["placed"], nodes)
    assert run["placed"]["decode"] == [nodes["decode_node"]] * 2, (run["placed"], nodes)
    assert run["outputs"] == expected
    assert all(e.startswith("127.0.0.1:") for e in run["endpoints"]), run["endpoints"]   # bind host "auto"


def test_grpc_actors_listen_on_loopback_only(multinode):
    listeners = multinode[0]["runs"]["grpc"]["listeners"]
    assert listeners and all(addr.startswith(LOOPBACK) for _, addr in listeners), listeners


def test_torch_actors_listen_on_loopback_only(multinode):
    listeners = multinode[0]["runs"]["torch"]["listeners"]
    assert listeners and all(addr.startswith(LOOPBACK) for _, addr in listeners), listeners
