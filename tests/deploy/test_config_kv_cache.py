"""The kv_cache section's block budget (deploy/config/kv_cache.py)."""
from __future__ import annotations

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
