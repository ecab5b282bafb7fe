"""Looking inside a simulated run: the cluster `bench.simulate.run.simulate` built, kept for the test."""
from __future__ import annotations

from bench.simulate import run as run_module


def keep_built_cluster(monkeypatch) -> dict:
    """After the next `simulate(...)`, the returned dict's "cluster" is the `SimCluster` it ran on."""
    held = {}
    real_build = run_module.build_cluster

    def keep(*args, **kwargs):
        held["cluster"] = cluster = real_build(*args, **kwargs)
        return cluster
    monkeypatch.setattr(run_module, "build_cluster", keep)
    return held
