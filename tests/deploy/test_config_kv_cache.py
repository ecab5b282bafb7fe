"""The kv_cache section's block budget (deploy/config/kv_cache.py)."""
from __future__ import annotations

import pytest

from deploy.config import KVCacheSection


def test_resolve_num_blocks():
    assert KVCacheSection(num_blocks=7).resolve_num_blocks(1024) == 7
    assert KVCacheSection(memory_gib=1).resolve_num_blocks(1 << 20) == 1024
    assert KVCacheSection(memory_fraction=0.5).resolve_num_blocks(100, free_bytes=1000) == 5
    assert KVCacheSection().resolve_num_blocks(100, free_bytes=1000) == 9  # default 0.9


def test_device_fraction_only_for_a_fraction_budget():
    assert KVCacheSection().device_fraction() == 0.9
    assert KVCacheSection(memory_fraction=0.5).device_fraction() == 0.5
    assert KVCacheSection(num_blocks=7).device_fraction() is None
    assert KVCacheSection(memory_gib=2).device_fraction() is None


def test_gpu_actors_size_their_cache_from_the_device():
    """engine_args: a GPU pool with a fraction budget hands the fraction to the engine (measured on the
    device); CPU pools and explicit budgets keep the count computed here, as before."""
    from deploy.config import load_config
    from deploy.launcher import engine_args
    from engine.model.presets import resolve_model
    model_dir = resolve_model("tiny")
    gpu = load_config(None, {"pools.decode.resources.num_gpus": 1, "kv_cache.memory_fraction": 0.8})
    assert engine_args(gpu, "decode", model_dir).kv_memory_fraction == 0.8
    assert engine_args(gpu, "prefill", model_dir).kv_memory_fraction is None   # prefill stays on CPU here
    cpu = load_config(None, {"kv_cache.memory_fraction": 0.8})
    cpu_args = engine_args(cpu, "decode", model_dir)
    assert cpu_args.kv_memory_fraction is None and cpu_args.num_blocks >= 1
    fixed = load_config(None, {"pools.decode.resources.num_gpus": 1, "kv_cache.num_blocks": 99})
    fixed_args = engine_args(fixed, "decode", model_dir)
    assert fixed_args.kv_memory_fraction is None and fixed_args.num_blocks == 99


def _with_tiers(tmp_path, tiers: str):
    from deploy.config import load_config
    path = tmp_path / "pools.yaml"
    path.write_text(f"kv_cache:\n  tiers:\n{tiers}")
    return load_config(str(path))


def test_tiers_reach_every_actor_with_its_own_disk_directory(tmp_path):
    from deploy.launcher import actor_tiers, engine_args
    from engine.kv_cache.tiers import TierSpec
    from engine.model.presets import resolve_model
    cfg = _with_tiers(tmp_path, "    - {kind: host, capacity_gib: 0.5}\n"
                                "    - {kind: disk, capacity_gib: 2, path: kv, fsync: always, reopen: true}\n")
    args = engine_args(cfg, "decode", resolve_model("tiny"))
    disk = TierSpec("disk", 2 << 30, str(tmp_path / "kv"), "always", True)
    assert args.kv_tiers == (TierSpec("host", 1 << 29), disk)        # the path is relative to the file
    assert actor_tiers(args.kv_tiers, "decode-1")[1].path == str(tmp_path / "kv" / "decode-1")
    assert _with_tiers(tmp_path, "    []\n").kv_cache.tiers == []     # the default: no tiers


@pytest.mark.parametrize("tiers, key, words", [
    ("    - {kind: host}\n", "kv_cache.tiers.0.capacity_gib", "required"),
    ("    - {kind: disk, capacity_gib: 1}\n", "kv_cache.tiers.0.path", "needs a directory"),
    ("    - {kind: disk, capacity_gib: 1, path: afile/kv}\n", "kv_cache.tiers.0.path", "not a writable directory"),
    ("    - {kind: host, capacity_gib: 0}\n", "kv_cache.tiers.0.capacity_gib", "must be > 0"),
    ("    - {kind: disk, capacity_gib: 1, path: kv}\n    - {kind: host, capacity_gib: 1}\n",
     "kv_cache.tiers.1.kind", "above the disk tier"),
    ("    - {kind: tape, capacity_gib: 1}\n", "kv_cache.tiers.0.kind", "unknown value"),
])
def test_bad_tier_names_the_key(tmp_path, tiers, key, words):
    from deploy.config import ConfigError
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError) as err:
        _with_tiers(tmp_path, tiers)
    assert err.value.key == key and words in str(err.value), str(err.value)
