"""The performance model a cluster starts from (`engine.performance`), and the router's live model on it.

The measured profile of the config (`pdserve profile`, `deploy.profiler.default_profile_path`) when there is
one; a cluster whose pools the autoscaler sizes and that has none measures its first actors quickly
(`quick_profile`); otherwise `LinearPerformance`'s generic figures, which the first requests' reports
correct. The router's `LiveProfile` rests on that base, and the autoscaler asks the same object, so
placement and pool sizing read one model of one cluster.

With `speculative.method` on, the model carries a `Speculation` (`speculation_of`): the configured method
and k, an acceptance rate to start from (given, or the profile's measurement on the model's held-out
text), and for the draft method the draft's cost relative to the target's step where the profile did not
measure the speculative step. The router's live model then takes the acceptance the decode actors report.
"""
from __future__ import annotations

import logging
import os

import torch

from deploy.config import PDServeConfig
from deploy.profiler import default_profile_path, load_profile, plan_points, profile_actors
from engine.cost_model import ModelCosts
from engine.engine import pick_dtype
from engine.kv_cache.kv_format import KVFormat
from engine.model.config import ModelConfig
from engine.model.presets import resolve_model
from engine.performance import LinearPerformance, MeasuredPerformance, PerformanceModel, Speculation
from engine.spec.tokens_per_step import acceptance_ratio, per_token_acceptance
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


def measured_acceptance(profile: dict | None, method: str, num_tokens: int) -> float | None:
    """The acceptance rate `profile` measured for `method` on the model's held-out text, at `num_tokens`
    proposals per step (converted through the per-token rate when it was measured at another k); None
    where it has none."""
    spec = (profile or {}).get("speculative") or {}
    measured = spec.get("acceptance") or {}
    if spec.get("method") != method or measured.get("ratio") is None or not measured.get("num_tokens"):
        return None
    if measured["num_tokens"] == num_tokens:
        return measured["ratio"]
    return acceptance_ratio(per_token_acceptance(measured["ratio"], measured["num_tokens"]), num_tokens)


def draft_cost(cfg: PDServeConfig, model_dir: str) -> float:
    """`draft_cost_of` the config's draft model and the model in `model_dir`."""
    return draft_cost_of(ModelConfig.from_dir(resolve_model(cfg.speculative.draft.model)),
                         ModelConfig.from_dir(model_dir))


def draft_cost_of(draft: ModelConfig, target: ModelConfig) -> float:
    """Seconds of one draft forward per second of a target step, counted as the weight bytes each reads
    (`engine.cost_model`; both bound by reading their weights at small batches, in the same dtype)."""
    return ModelCosts.of(draft, 4).weight_bytes / ModelCosts.of(target, 4).weight_bytes


def speculation_of(cfg: PDServeConfig, model_dir: str, profile: dict | None = None,
                   acceptance: float | None = None) -> Speculation | None:
    """The decode actors' speculative decoding as the performance model sees it; None with
    `speculative.method` off. Its acceptance: `acceptance` when given, else the profile's measurement, else 0
    (no speed-up predicted until the decode actors report theirs)."""
    s = cfg.speculative
    if s.method == "off":
        return None
    return Speculation(s.method, s.engine_config().k, configured_acceptance(cfg, profile, acceptance) or 0.0,
                       s.adaptive, draft_cost(cfg, model_dir) if s.method == "draft" else 0.0)


def configured_acceptance(cfg: PDServeConfig, profile: dict | None, acceptance: float | None) -> float | None:
    """The speculation's acceptance ratio: `acceptance` when given, else what `profile` measured for the
    config's method at its k; None when neither knows one."""
    s = cfg.speculative
    return acceptance if acceptance is not None else measured_acceptance(profile, s.method, s.engine_config().k)


def base_model(cfg: PDServeConfig, model_dir: str, profile: dict | None) -> PerformanceModel:
    """`profile` as a model; without one, the generic figures (with the model's own KV bytes per token); with
    the config's speculative decoding (`speculation_of`)."""
    speculation = speculation_of(cfg, model_dir, profile)
    if profile is not None:
        return MeasuredPerformance(profile, speculation)
    mcfg = ModelConfig.from_dir(model_dir)
    device = torch.device("cuda" if cfg.pools.decode.resources.num_gpus else "cpu")
    kv = cfg.pool_kv_cache("decode")
    kv_per_token = KVFormat(kv.dtype, mcfg.num_hidden_layers, mcfg.num_key_value_heads, kv.block_size, mcfg.head_dim,
                            pick_dtype(cfg.model.dtype, device)).bytes_per_token
    log.info("performance model: generic figures until requests report")
    return LinearPerformance(kv_bytes_per_token=kv_per_token, speculation=speculation)


def live_model(cfg: PDServeConfig, base: PerformanceModel) -> LiveProfile:
    """The router's live model on `base`."""
    return LiveProfile(base, cfg.kv_cache.block_size, cfg.pools.prefill.chunk_tokens)
