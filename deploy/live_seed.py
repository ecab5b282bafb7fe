"""The starting point of the router's live profile (`router.placement.live_profile`) for `routing.mode: auto`.

From the config's cached measured profile (`pdserve profile`, `deploy.profiler.default_profile_path`)
when there is one: prefill tokens/s at the workload's prompt length, the decode step's line through
batch 1 and the pool's max batch at the workload's context, the KV link's bytes/s. Without one, the
generic figures of `ProfileSeed`, which the first requests' own reports replace. KV bytes per token
and the chunk size come from the model and the config either way.
"""
from __future__ import annotations

import logging
import os

import torch

from deploy.config import PDServeConfig
from deploy.profiler import Profile, default_profile_path, load_profile
from engine.model.config import ModelConfig
from engine.engine import pick_dtype
from router.placement.live_profile import ProfileSeed

log = logging.getLogger(f"pdserve.{__name__}")


def seed_from_profile(profile: Profile, cfg: PDServeConfig, kv_bytes_per_token: float) -> ProfileSeed:
    """The seed a measured profile gives for the config's workload."""
    w, batch = cfg.workload, cfg.pools.decode.max_batch_size
    context = w.input_tokens_mean + w.output_tokens_mean / 2
    step_1 = profile.decode_step_seconds(1, context)
    step_n = profile.decode_step_seconds(max(batch, 2), context)
    per_seq = max((step_n - step_1) / (max(batch, 2) - 1), 0.0)
    link = profile.transfer.get("kv_bytes_per_s") or ProfileSeed.kv_bytes_per_s
    return ProfileSeed(prefill_tokens_per_s=profile.prefill_capacity(w.input_tokens_mean),
                       kv_bytes_per_s=float(link), kv_bytes_per_token=kv_bytes_per_token,
                       step_base_s=max(step_1 - per_seq, 0.0), step_per_seq_s=per_seq,
                       chunk_tokens=cfg.pools.prefill.chunk_tokens)


def live_seed(cfg: PDServeConfig, model_dir: str) -> ProfileSeed:
    """The config's cached profile as a seed, else the generic figures (one log line says which)."""
    mcfg = ModelConfig.from_dir(model_dir)
    device = torch.device("cuda" if cfg.pools.decode.resources.num_gpus else "cpu")
    kv_per_token = float(mcfg.kv_bytes_per_token(pick_dtype(cfg.model.dtype, device).itemsize))
    path = default_profile_path(cfg)
    if os.path.isfile(path):
        try:
            seed = seed_from_profile(Profile(load_profile(path)), cfg, kv_per_token)
            log.info("auto placement seeded from the measured profile %s", path)
            return seed
        except (ValueError, KeyError) as e:
            log.warning("auto placement: cannot use profile %s (%s); generic figures until measured", path, e)
    else:
        log.info("auto placement: no measured profile for this config; generic figures until requests report")
    return ProfileSeed(kv_bytes_per_token=kv_per_token, chunk_tokens=cfg.pools.prefill.chunk_tokens)
