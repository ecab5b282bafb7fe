"""Run as a script: start a local Ray instance the way `pdserve serve` does (token through
``security.token_env``), start one actor, and print as JSON which of Ray's processes carry the token
in their environment or command line. ``--keep-env`` starts Ray without holding the variable out."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import ray

from deploy.config import load_config
from deploy.launcher import init_ray, init_ray_for


@ray.remote(num_cpus=0)
class Probe:
    def pid(self) -> int:
        return os.getpid()


def carriers(secret: bytes) -> list[str]:
    """The processes other than this one whose environ or cmdline holds ``secret``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if secret in (proc / "environ").read_bytes() or secret in (proc / "cmdline").read_bytes():
                found.append((proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace"))
        except OSError:   # gone, or not ours
            continue
    return found


def main() -> None:
    token = os.environ["PDSERVE_PROBE_TOKEN"]
    if "--keep-env" in sys.argv:
        init_ray(num_cpus=1)
    else:
        init_ray_for(load_config(None, {"security.token_env": "PDSERVE_PROBE_TOKEN"}), num_cpus=1)
    actor_pid = ray.get(Probe.remote().pid.remote(), timeout=120)
    print(json.dumps({"actor_pid": actor_pid, "carriers": carriers(token.encode()),
                      "driver_keeps_it": os.environ.get("PDSERVE_PROBE_TOKEN") == token}))
    ray.shutdown()


if __name__ == "__main__":
    main()
