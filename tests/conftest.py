"""Shared fixtures: tiny model directories, loopback-only networking for every test."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines outside tests/engine (Ray actors included: they inherit this) skip the few seconds of
# compiling the decode-attention kernel; tests/engine runs the default and checks both paths.
os.environ.setdefault("PDSERVE_ATTENTION", "eager")


@pytest.fixture(scope="session", autouse=True)
def _isolated_model_cache(tmp_path_factory):
    """Presets are materialized once per test session into a private cache."""
    if "PDSERVE_CACHE" not in os.environ:
        os.environ["PDSERVE_CACHE"] = str(tmp_path_factory.mktemp("pdserve-cache"))
    yield


@pytest.fixture(scope="session")
def tiny_model_dir(_isolated_model_cache) -> str:
    from engine.model.presets import resolve_model
    return resolve_model("tiny")


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """Colocated Engine outputs: the bit-exact reference."""
    from engine import Engine, EngineArgs
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=1024))

    def run(prompts, params):
        return [c.token_ids for c in engine.generate(prompts, params)]
    return run


@pytest.fixture
def pair(tiny_model_dir):
    """A started prefill and decode worker joined by the fake transport (tests/worker_support.py)."""
    from worker_support import worker_pair
    prefill, decode, hub = worker_pair(tiny_model_dir)
    yield prefill, decode, hub
    prefill.stop()
    decode.stop()
