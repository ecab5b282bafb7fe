"""The public token read through ``security.token_env`` stays in the router's process: no Ray process
(GCS, raylet, worker, actor) started for a local cluster carries it in /proc/<pid>/environ or its
command line. The same probe without the launcher's hold-out shows the token there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("ray_environ_probe.py")
ROOT = Path(__file__).resolve().parents[2]


def _probe(*flags: str) -> dict:
    env = {**os.environ, "PDSERVE_PROBE_TOKEN": "probe-token-5f1c2a", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(PROBE), *flags], env=env, capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_no_ray_process_carries_the_public_token():
    seen = _probe()
    assert seen["carriers"] == [] and seen["driver_keeps_it"]
    leaked = _probe("--keep-env")      # the same start without the hold-out: the token is in every Ray process
    assert any("raylet" in name for name in leaked["carriers"]) and len(leaked["carriers"]) >= 3
