"""Rotary position embeddings, with `linear` and `llama3` frequency scaling and partial rotation (Phi-3)."""
from __future__ import annotations

import math

import torch

from engine.model.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [rotary_dim // 2], scaled as the config asks (float32)."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3_scale(inv, scaling)
    return inv


def _llama3_scale(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


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
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
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
