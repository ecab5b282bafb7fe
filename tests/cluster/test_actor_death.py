"""`deploy.actor_death.death_report` tells a kill from a crash from a retirement, on real Ray actors."""
from __future__ import annotations

import faulthandler
import os
import signal
import time

import pytest
import ray

from deploy.actor_death import death_report


@ray.remote(num_cpus=0, max_restarts=0)
class Victim:
    def __init__(self, fail: bool = False) -> None:
        faulthandler.enable()
        if fail:
            raise RuntimeError("no model directory at /nowhere")

    def pid(self) -> int:
        print("victim serving", flush=True)
        return os.getpid()

    def segfault(self) -> None:
        import ctypes
        ctypes.string_at(0)

    def hang(self) -> None:
        time.sleep(60)


def _dead(handle, pid: int) -> str:
    """The report once Ray has the death (its table says DEAD) and the process is gone."""
    end = time.monotonic() + 30
    while True:
        entry = ray._private.state.actors(handle._actor_id.hex())
        if entry.get("State") == "DEAD" and not os.path.exists(f"/proc/{pid}"):
            return death_report(handle._actor_id.hex(), pid)
        assert time.monotonic() < end, entry.get("State")
        time.sleep(0.05)


def test_a_sigkill_is_told_from_a_native_crash_and_a_retirement(ray_local):
    killed, crashed, retired = Victim.remote(), Victim.remote(), Victim.remote()
    pids = ray.get([killed.pid.remote(), crashed.pid.remote(), retired.pid.remote()], timeout=60)
    os.kill(pids[0], signal.SIGKILL)
    crashed.segfault.remote()
    ray.kill(retired, no_restart=True)
    report = _dead(killed, pids[0])
    assert report.startswith("went away without a word: killed outright (SIGKILL") and "victim serving" in report
    report = _dead(crashed, pids[1])
    assert report.startswith("crashed in native code") and "Fatal Python error: Segmentation fault" in report
    assert _dead(retired, pids[2]).startswith("killed by ray.kill")


def test_a_constructor_that_raises_and_a_hung_actor(ray_local):
    broken = Victim.remote(fail=True)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(broken.pid.remote(), timeout=60)
    report = death_report(broken._actor_id.hex(), 0)
    assert "crashed with a Python exception" in report and "no model directory at /nowhere" in report
    hung = Victim.remote()
    pid = ray.get(hung.pid.remote(), timeout=60)
    hung.hang.remote()
    assert death_report(hung._actor_id.hex(), pid).startswith(f"its process {pid} is alive but does not answer")
    ray.kill(hung, no_restart=True)
