"""The performance model a cluster starts from (`engine.performance`), and the router's live model on it.

The measured profile of the config (`pdserve profile`, `deploy.profiler.default_profile_path`) when there is
one; a cluster whose pools the autoscaler sizes and that has none measures its first actors quickly
(`quick_profile`); otherwise `LinearPerformance`'s generic figures, which the first requests' reports
correct. The router's `LiveProfile` rests on that base, and the autoscaler asks the same object, so
placement and pool sizing read one model of one cluster.
"""
from __future__ import annotations

import logging
import os

import torch

from deploy.config import PDServeConfig
from deploy.profiler import default_profile_path, load_profile, plan_points, profile_actors
from engine.engine import pick_dtype
from engine.kv_cache.kv_format import KVFormat
from engine.model.config import ModelConfig
from engine.performance import LinearPerformance, MeasuredPerformance, PerformanceModel
from router.placement import LiveProfile

log = logging.getLogger(f"pdserve.{__name__}")


def cached_profile(cfg: PDServeConfig) -> dict | None:
    """The config's cached measured profile, or None (one log line says which)."""
    path = default_profile_path(cfg)
    if not os.path.isfile(path):
        log.info("no measured profile for this config yet (pdserve profile)")
        return None
    try:
        profile = load_profile(path)
    except ValueError as e:
        log.warning("cannot use profile %s (%s)", path, e)
        return None
    log.info("performance model: the measured profile %s", path)
    return profile


async def quick_profile(cfg: PDServeConfig, handles: dict, model_dir: str) -> dict:
    """A quick profile measured on running actors: handles = {"prefill": actor, "decode": actor}."""
    log.info("measuring the first actors for the performance model (quick profile)")
    return await profile_actors(handles, plan_points(cfg, model_dir, quick=True), progress=False)


def base_model(cfg: PDServeConfig, model_dir: str, profile: dict | None) -> PerformanceModel:
    """`profile` as a model; without one, the generic figures (with the model's own KV bytes per token)."""
    if profile is not None:
        return MeasuredPerformance(profile)
    mcfg = ModelConfig.from_dir(model_dir)
    device = torch.device("cuda" if cfg.pools.decode.resources.num_gpus else "cpu")
    kv = cfg.pool_kv_cache("decode")
    kv_per_token = KVFormat(kv.dtype, mcfg.num_hidden_layers, mcfg.num_key_value_heads, kv.block_size, mcfg.head_dim,
                            pick_dtype(cfg.model.dtype, device)).bytes_per_token
    log.info("performance model: generic figures until requests report")
    return LinearPerformance(kv_bytes_per_token=kv_per_token)


def live_model(cfg: PDServeConfig, base: PerformanceModel) -> LiveProfile:
    """The router's live model on `base`."""
    return LiveProfile(base, cfg.kv_cache.block_size, cfg.pools.prefill.chunk_tokens)
