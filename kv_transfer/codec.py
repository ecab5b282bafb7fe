"""KV codecs: how one chunk of blocks becomes payload bytes and back.

A chunk is ``x: [l, n, 2, H, B, D]`` (layers x blocks x K/V x kv heads x
block_size x head_dim) in the model dtype. Its payload is

    scales (float32, ``scales_shape``) ++ data (``wire_dtype``, x.shape)

Codecs:
    none       model dtype, bit-exact, no scales.
    fp8        float8_e4m3fn data, one float32 scale per (layer, block, K/V,
               kv head): scale = amax / 448. All-zero groups get scale 0.
    fp8_tensor float8_e4m3fn data, one scale per encoded tensor (the
               per-tensor baseline; on the wire one scale per chunk).

Everything is vectorized over the whole chunk; NaN/Inf in the KV raises.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class CodecError(ValueError):
    """The KV cannot be encoded (NaN/Inf) or a payload cannot be decoded."""


class Codec(ABC):
    name: str
    scale_layout: str  # "none" | "block" | "tensor"

    @abstractmethod
    def scales_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]: ...

    @abstractmethod
    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype: ...

    def scales_nbytes(self, shape: tuple[int, ...]) -> int:
        scales_shape = self.scales_shape(shape)
        return 4 * math.prod(scales_shape) if scales_shape else 0

    def payload_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return self.scales_nbytes(shape) + math.prod(shape) * self.wire_dtype(dtype).itemsize

    def _split(self, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype):
        """payload: uint8 [nbytes] -> (scales float32 view, data view of ``shape``)."""
        scales_shape = self.scales_shape(shape)
        num_scale_bytes = self.scales_nbytes(shape)
        scales = payload[:num_scale_bytes].view(torch.float32).view(scales_shape) if scales_shape else None
        data = payload[num_scale_bytes:].view(self.wire_dtype(dtype)).view(shape)
        return scales, data

    def encode_from(self, kv_cache: torch.Tensor, layers: tuple[int, int], index: torch.Tensor, out: torch.Tensor) -> None:
        """Gather ``kv_cache[l0:l1, index]`` and encode it into ``out`` (uint8 [payload_nbytes])."""
        self.encode(kv_cache[layers[0] : layers[1]].index_select(1, index), out)

    @abstractmethod
    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None: ...

    @abstractmethod
    def decode(self, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class NoneCodec(Codec):
    name = "none"
    scale_layout = "none"

    def scales_shape(self, shape):
        return ()

    def wire_dtype(self, dtype):
        return dtype

    def encode_from(self, kv_cache, layers, index, out):
        shape = (layers[1] - layers[0], index.numel(), *kv_cache.shape[2:])
        torch.index_select(kv_cache[layers[0] : layers[1]], 1, index, out=out.view(kv_cache.dtype).view(shape))

    def encode(self, x, out):
        out.view(x.dtype).view(x.shape).copy_(x)

    def decode(self, payload, shape, dtype):
        return self._split(payload, shape, dtype)[1]


class _Fp8Codec(Codec):
    def wire_dtype(self, dtype):
        return FP8

    @abstractmethod
    def _amax(self, x: torch.Tensor) -> torch.Tensor: ...

    def encode(self, x, out):
        # x: [l, n, 2, H, B, D]; amax: scales_shape
        scales, data = self._split(out, tuple(x.shape), x.dtype)
        amax = self._amax(x).float()
        if not bool(torch.isfinite(amax).all()):
            raise CodecError("KV cache holds NaN or Inf; refusing to encode it as fp8")
        torch.div(amax, FP8_MAX, out=scales)
        inv = torch.where(amax > 0, FP8_MAX / amax, 0.0)  # all-zero group -> multiply by 0
        inv = inv.reshape(inv.shape + (1,) * (x.dim() - inv.dim()))
        data.copy_(x * inv)  # x * inv stays within [-448, 448]; copy_ casts to e4m3

    def decode(self, payload, shape, dtype):
        scales, data = self._split(payload, shape, dtype)
        scales = scales.reshape(scales.shape + (1,) * (len(shape) - scales.dim()))
        return (data.to(torch.float32) * scales).to(dtype)


class Fp8BlockCodec(_Fp8Codec):
    name = "fp8"
    scale_layout = "block"

    def scales_shape(self, shape):
        return tuple(shape[:4])  # [l, n, 2, H]

    def _amax(self, x):
        return torch.maximum(x.amax(dim=(-2, -1)), -x.amin(dim=(-2, -1)))


class Fp8TensorCodec(_Fp8Codec):
    name = "fp8_tensor"
    scale_layout = "tensor"

    def scales_shape(self, shape):
        return (1,)

    def _amax(self, x):
        return torch.maximum(x.amax(), -x.amin()).reshape(1)


CODECS: dict[str, Codec] = {codec.name: codec for codec in (NoneCodec(), Fp8BlockCodec(), Fp8TensorCodec())}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown KV codec {name!r}; expected one of {sorted(CODECS)}") from None
