"""Rotary position embeddings, with `linear`, `llama3` and `yarn` scaling and partial rotation (Phi-3).

Each scaling is transformers' (modeling_rope_utils.py) for the same config: `inv_frequencies` gives the
per-pair frequencies and `attention_factor` what cos and sin are multiplied by (1 but for YaRN), so the
rotated q·k scales by its square. engine/model/config.py refuses the scalings and keys not applied here.
"""
from __future__ import annotations

import math

import torch

from engine.model.config import YARN_BETA_FAST, YARN_BETA_SLOW, ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [rotary_dim // 2], scaled as the config asks (float32)."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = cfg.rope_type
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3_scale(inv, scaling, cfg.max_position_embeddings)
    elif kind == "yarn":
        inv = _yarn_scale(inv, scaling, cfg.rope_theta, dim, cfg.max_position_embeddings)
    return inv


def attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's (`attention_factor`, else from `factor` and the
    `mscale` / `mscale_all_dim` pair); 1.0 for every other scaling."""
    if cfg.rope_type != "yarn":
        return 1.0
    scaling = cfg.rope_scaling
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor, 1.0)


def _yarn_mscale(factor: float, mscale: float) -> float:
    """The YaRN paper's attention temperature, 0.1 * mscale * ln(factor) + 1 (1 when not stretching)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3_scale(inv: torch.Tensor, s: dict, max_positions: int) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", max_positions))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_scale(inv: torch.Tensor, s: dict, base: float, dim: int, max_positions: int) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): pairs that turn many times over the pretraining context keep their
    frequency, pairs that turn less than once are interpolated (divided by `factor`), and a linear
    ramp over the pair index blends the two between `beta_fast` and `beta_slow` rotations."""
    factor = float(s["factor"])
    old_len = float(s.get("original_max_position_embeddings", max_positions))
    beta_fast, beta_slow = float(s.get("beta_fast") or YARN_BETA_FAST), float(s.get("beta_slow") or YARN_BETA_SLOW)

    def pair_turning(turns: float) -> float:
        """The (fractional) pair index whose frequency turns `turns` times over `old_len` positions."""
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    first, last = pair_turning(beta_fast), pair_turning(beta_slow)
    if s.get("truncate", True):
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, dim - 1)       # dim - 1 as transformers bounds it (dim / 2 pairs)
    if first == last:
        last += 0.001                                     # a step, not a division by zero
    pair = torch.arange(dim // 2, dtype=torch.float32)
    interpolated = ((pair - first) / (last - first)).clamp(0, 1)   # [D/2]: 0 keeps, 1 divides by factor
    keep = 1 - interpolated
    return inv / factor * (1 - keep) + inv * keep


class RotaryEmbedding:
    """Caches cos/sin for every position up to `max_positions`; `apply` rotates q and k.

    With a partial rotary factor only the first `rotary_dim` dims of each head rotate; the
    cached cos/sin are padded with 1/0 over the rest, so one expression serves both cases.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype):
        inv = inv_frequencies(cfg).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)                       # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)           # [P, R]
        self.rotary_dim = emb.shape[-1]
        scale = attention_factor(cfg)                     # scaled in float32 before the cast, as transformers
        self.cos = (emb.cos() * scale).to(dtype)
        self.sin = (emb.sin() * scale).to(dtype)
        if self.rotary_dim < cfg.head_dim:
            pad = cfg.head_dim - self.rotary_dim
            self.cos = torch.cat((self.cos, self.cos.new_ones(max_positions, pad)), dim=-1)   # [P, D]
            self.sin = torch.cat((self.sin, self.sin.new_zeros(max_positions, pad)), dim=-1)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        # q: [T, Hq, D], k: [T, Hkv, D], positions: [T]
        cos = self.cos[positions].unsqueeze(1)            # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        r = self.rotary_dim
        return q * cos + _rotate_half(q, r) * sin, k * cos + _rotate_half(k, r) * sin


def _rotate_half(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Each rotated pair (i, i + rotary_dim/2) as (-x2, x1); dims past rotary_dim stay (sin is 0 there)."""
    half = rotary_dim // 2
    parts = (-x[..., half:rotary_dim], x[..., :half])
    if rotary_dim < x.shape[-1]:
        parts += (x[..., rotary_dim:],)
    return torch.cat(parts, dim=-1)
