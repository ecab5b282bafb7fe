"""KV codecs: how one chunk of blocks becomes payload bytes and back.

A chunk is ``x: [l, n, 2, H, B, D]`` (layers x blocks x K/V x kv heads x
block_size x head_dim) in the model dtype. Its payload is

    scales (float32, ``scales_shape``) ++ data (``wire_dtype``, x.shape)

Codecs:
    none       model dtype, bit-exact, no scales.
    fp8        float8_e4m3fn data, one float32 scale per (layer, block, K/V,
               kv head): scale = amax / 448. All-zero groups get scale 0.
    int8       int8 data, one float32 scale per (layer, block, K/V, kv head,
               token): scale = amax over head_dim / 127, round to nearest,
               clamp to +-127. All-zero rows get scale 0.
    fp8_tensor float8_e4m3fn data, one scale per encoded tensor (the
               per-tensor baseline; on the wire one scale per chunk).
    fp8_cache, int8_cache
               the cells of an fp8 / int8 KV cache as stored (`StoredCodec`):
               the fp8 / int8 schemes above, shipped without encode or decode.

Everything is vectorized over the whole chunk; NaN/Inf in the KV raises.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

import kv_transfer.codec_compiled as codec_compiled
from kv_transfer.buffers import Scratch
from kv_transfer.head_view import cell_parts

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0


def pin_transfer_thread() -> None:
    """Run this thread's torch ops on one core.

    Encode and decode run on transport threads beside the model's own
    intra-op pool; letting each of them fan out too oversubscribes the cores
    (on a busy 2-core machine a 2-thread fp8 encode ran 10x slower than a
    1-thread one). The setting is per thread: the engine's threads keep theirs.
    """
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


class CodecError(ValueError):
    """The KV cannot be encoded (NaN/Inf) or a payload cannot be decoded."""


class Codec(ABC):
    name: str
    scale_layout: str  # "none" | "block" | "token" | "tensor"
    lossy: bool = True
    as_stored: bool = False   # the payload is the cache's own cells (transports may send and receive them in place)

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

    def prepare(self, kv_cache: torch.Tensor) -> None:
        """Start building whatever fast kernels this codec has for ``kv_cache`` (no-op by default)."""

    def encode_from(self, kv_cache: torch.Tensor, layers: tuple[int, int], index: torch.Tensor, out: torch.Tensor,
                    scratch: Scratch | None = None) -> None:
        """Gather ``kv_cache[l0:l1, index]`` and encode it into ``out`` (uint8 [payload_nbytes])."""
        scratch = scratch or Scratch()
        shape = (layers[1] - layers[0], index.numel(), *kv_cache.shape[2:])
        x = scratch.get("gather", shape, kv_cache.dtype, kv_cache.device)
        torch.index_select(kv_cache[layers[0] : layers[1]], 1, index, out=x)
        self.encode(x, out, scratch)

    def decode_into(self, payload: torch.Tensor, shape: tuple[int, ...], kv_cache: torch.Tensor,
                    layers: tuple[int, int], index: torch.Tensor, scratch: Scratch | None = None) -> None:
        """Decode a payload of ``shape`` into ``kv_cache[l0:l1, index]`` (the cache's dtype)."""
        write_blocks(kv_cache[layers[0] : layers[1]], index, self.decode(payload, shape, kv_cache.dtype, scratch))

    def roundtrip(self, kv_cache: torch.Tensor, index: torch.Tensor) -> None:
        """Rewrite ``kv_cache[:, index]`` (every layer) as a transfer through this codec delivers it.

        Per-block (fp8) and per-token (int8) scales make this exact for any grouping of blocks;
        the per-tensor baseline's one scale depends on which blocks a chunk held.
        """
        shape = (kv_cache.shape[0], index.numel(), *kv_cache.shape[2:])
        payload = torch.empty(self.payload_nbytes(shape, kv_cache.dtype), dtype=torch.uint8, device=kv_cache.device)
        self.encode_from(kv_cache, (0, shape[0]), index, payload)
        self.decode_into(payload, shape, kv_cache, (0, shape[0]), index)

    @abstractmethod
    def encode(self, x: torch.Tensor, out: torch.Tensor, scratch: Scratch | None = None) -> None: ...

    @abstractmethod
    def decode(self, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
               scratch: Scratch | None = None) -> torch.Tensor:
        """payload -> [l, n, 2, H, B, D] in ``dtype``; may be a view of ``scratch`` (copy it out before reuse)."""


class NoneCodec(Codec):
    name = "none"
    scale_layout = "none"
    lossy = False
    as_stored = True

    def scales_shape(self, shape):
        return ()

    def wire_dtype(self, dtype):
        return dtype

    def encode_from(self, kv_cache, layers, index, out, scratch=None):
        shape = (layers[1] - layers[0], index.numel(), *kv_cache.shape[2:])
        torch.index_select(kv_cache[layers[0] : layers[1]], 1, index, out=out.view(kv_cache.dtype).view(shape))

    def encode(self, x, out, scratch=None):
        out.view(x.dtype).view(x.shape).copy_(x)

    def roundtrip(self, kv_cache, index):
        return None       # bit-exact: nothing changes

    def decode(self, payload, shape, dtype, scratch=None):
        return self._split(payload, shape, dtype)[1]


# Bit patterns of |x| order like the values, so amax runs on integers (one
# pass, no abs() copy) and the non-finite check is a compare on the result.
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_ABS_MASK = {torch.float32: 0x7FFFFFFF, torch.bfloat16: 0x7FFF, torch.float16: 0x7FFF}
_INF_BITS = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


class _ScaledCodec(Codec):
    """One float32 scale per group of values; a group is what ``_reduce_dims`` reduces over."""

    @abstractmethod
    def _reduce_dims(self, x: torch.Tensor) -> tuple[int, ...]: ...

    def _amax(self, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        """max |x| over ``_reduce_dims`` as float32; raises on NaN/Inf."""
        int_view = x.view(_INT_VIEW[x.dtype])
        bits = scratch.get("abs_bits", tuple(x.shape), int_view.dtype, x.device)
        torch.bitwise_and(int_view, _ABS_MASK[x.dtype], out=bits)
        amax_bits = bits.amax(dim=self._reduce_dims(x))
        if bool((amax_bits >= _INF_BITS[x.dtype]).any()):
            raise CodecError(f"KV cache holds NaN or Inf; refusing to encode it as {self.name}")
        return amax_bits.view(x.dtype).float()


class _Fp8Codec(_ScaledCodec):
    def wire_dtype(self, dtype):
        return FP8

    def encode(self, x, out, scratch=None):
        # x: [l, n, 2, H, B, D]; scales: scales_shape (float32)
        scratch = scratch or Scratch()
        scales, data = self._split(out, tuple(x.shape), x.dtype)
        amax = self._amax(x, scratch).reshape(scales.shape)
        torch.div(amax, FP8_MAX, out=scales)
        inv = torch.where(amax > 0, FP8_MAX / amax, 0.0)  # all-zero group -> multiply by 0
        inv = inv.reshape(inv.shape + (1,) * (x.dim() - inv.dim()))
        # |x * inv| <= 448 (+ rounding): the e4m3 cast cannot overflow. float32 for every cache dtype,
        # as the compiled kernels: a payload's bytes never depend on which of the two made it.
        scaled = scratch.get("scaled", tuple(x.shape), torch.float32, x.device)
        scaled.copy_(x)
        scaled.mul_(inv)
        data.copy_(scaled)

    def decode(self, payload, shape, dtype, scratch=None):
        scratch = scratch or Scratch()
        scales, data = self._split(payload, shape, dtype)
        scales = scales.reshape(scales.shape + (1,) * (len(shape) - scales.dim()))
        # e4m3 -> float16 by bit moves: sign-extend, shift the 7 exponent+mantissa bits
        # into float16's place, clear the stray bit; a float16 subnormal is exactly an
        # e4m3 subnormal. The value is then 2^-8 of the e4m3 value: folded into the scale.
        bits = scratch.get("bits", shape, torch.int16, data.device)
        bits.copy_(data.view(torch.int8))
        bits.bitwise_left_shift_(7).bitwise_and_(-16385)  # 0xBFFF
        values = scratch.get("values", shape, torch.float32, data.device)
        values.copy_(bits.view(torch.float16))
        values.mul_(scales * 256.0)
        if dtype == torch.float32:
            return values
        out = scratch.get("out", shape, dtype, data.device)
        out.copy_(values)
        return out


class Fp8BlockCodec(_Fp8Codec):
    """Per-block scales. On a contiguous CPU cache, encode and decode run compiled kernels
    that read and write the cache's rows directly (kv_transfer.codec_compiled, C) once built."""

    name = "fp8"
    scale_layout = "block"

    def scales_shape(self, shape):
        return tuple(shape[:4])  # [l, n, 2, H]

    def _reduce_dims(self, x):
        return (-2, -1)

    def prepare(self, kv_cache):
        self._kernels(kv_cache)

    @staticmethod
    def _kernels(kv_cache: torch.Tensor):
        if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            return None
        return codec_compiled.kernels(kv_cache.dtype)

    def encode_from(self, kv_cache, layers, index, out, scratch=None):
        kernels = self._kernels(kv_cache)
        if kernels is None:
            return super().encode_from(kv_cache, layers, index, out, scratch)
        cells, rows = _rows(kv_cache, layers, index)
        scales, data = self._split(out, (layers[1] - layers[0], index.numel(), *kv_cache.shape[2:]), kv_cache.dtype)
        if not kernels[0](cells, rows, data.view(rows.numel(), *cells.shape[1:]), scales.view(rows.numel(), -1, 1)):
            raise CodecError("KV cache holds NaN or Inf; refusing to encode it as fp8")

    def decode_into(self, payload, shape, kv_cache, layers, index, scratch=None):
        kernels = self._kernels(kv_cache)
        if kernels is None:
            return super().decode_into(payload, shape, kv_cache, layers, index, scratch)
        cells, rows = _rows(kv_cache, layers, index)
        scales, data = self._split(payload, shape, kv_cache.dtype)
        kernels[1](data.view(rows.numel(), *cells.shape[1:]), scales.view(rows.numel(), -1, 1), cells, rows)


def _rows(kv_cache: torch.Tensor, layers: tuple[int, int], index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache as rows of cells [L * N, 2 * H, B * D], and the rows of ``kv_cache[l0:l1, index]``."""
    num_layers, num_blocks, two, heads, block_size, head_dim = kv_cache.shape
    cells = kv_cache.view(num_layers * num_blocks, two * heads, block_size * head_dim)
    layer_rows = torch.arange(layers[0], layers[1], device=index.device) * num_blocks
    return cells, (layer_rows[:, None] + index[None, :]).reshape(-1)


def write_blocks(dst: torch.Tensor, index: torch.Tensor, data: torch.Tensor) -> None:
    """dst[:, index] = data for dst [l, N, 2, H, B, D], data [l, n, 2, H, B, D].

    Both sides are viewed as [l, N or n, cell] in the widest integer words
    that divide a cell. On CPU, numpy's fancy assignment then copies each
    cell as one contiguous run (~4x faster here than ``index_copy_``, which
    moves words one at a time); on a device, ``index_copy_`` on those words.
    A cache that cannot be viewed that way is written element-wise.
    """
    try:
        dst_flat = dst.view(dst.shape[0], dst.shape[1], -1)
        data_flat = data.contiguous().view(data.shape[0], data.shape[1], -1)
        cell_bytes = dst_flat.shape[-1] * dst_flat.element_size()
        word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                    if cell_bytes % w.itemsize == 0 and dst.element_size() <= w.itemsize)
        dst_words, data_words = dst_flat.view(word), data_flat.view(word)
    except RuntimeError:  # not viewable (a strided cache): element-wise on the original shape
        dst.index_copy_(1, index, data)
        return
    if dst.device.type == "cpu":
        dst_words.numpy()[:, index.numpy()] = data_words.numpy()
    else:
        dst_words.index_copy_(1, index, data_words)


class Fp8TensorCodec(_Fp8Codec):
    name = "fp8_tensor"
    scale_layout = "tensor"

    def scales_shape(self, shape):
        return (1,)

    def _reduce_dims(self, x):
        return tuple(range(x.dim()))


class Int8TokenCodec(_ScaledCodec):
    """int8 with one float32 scale per (layer, block, K/V, kv head, token), the scheme of LMDeploy's
    int8 KV cache. A row's step is its own amax / 127, so the error does not depend on the other
    tokens of the block, and any grouping of blocks into chunks makes the same bytes."""

    name = "int8"
    scale_layout = "token"

    def scales_shape(self, shape):
        return tuple(shape[:5])  # [l, n, 2, H, B]

    def wire_dtype(self, dtype):
        return torch.int8

    def _reduce_dims(self, x):
        return (-1,)

    def encode(self, x, out, scratch=None):
        # x: [l, n, 2, H, B, D]; scales: [l, n, 2, H, B] (float32)
        scratch = scratch or Scratch()
        scales, data = self._split(out, tuple(x.shape), x.dtype)
        amax = self._amax(x, scratch)
        torch.div(amax, INT8_MAX, out=scales)
        inv = torch.where(amax > 0, INT8_MAX / amax, 0.0)     # all-zero row -> multiply by 0
        inv = inv.clamp_(max=torch.finfo(torch.float32).max).unsqueeze(-1)  # a subnormal amax: no inf (0 * inf = NaN)
        scaled = scratch.get("scaled", tuple(x.shape), torch.float32, x.device)
        scaled.copy_(x)
        scaled.mul_(inv).round_().clamp_(-INT8_MAX, INT8_MAX)   # nearest, ties to even
        data.copy_(scaled)

    def decode(self, payload, shape, dtype, scratch=None):
        scratch = scratch or Scratch()
        scales, data = self._split(payload, shape, dtype)
        values = scratch.get("values", shape, torch.float32, data.device)
        values.copy_(data)
        values.mul_(scales.unsqueeze(-1))
        if dtype == torch.float32:
            return values
        out = scratch.get("out", shape, dtype, data.device)
        out.copy_(values)
        return out


class StoredCodec(Codec):
    """The cells of a quantized KV cache (`kv_cache.dtype` fp8 / int8: engine/kv_cache/kv_format.py) as they are
    stored. Per (layer, block): the fp8 / int8 data [2, H, B, D], then its float32 scales [2, H, S] (S = 1 per
    block for fp8, B per token for int8): the scheme, scales included, of the wire codec it is named after. A
    prefill actor with such a cache ships its blocks as they are, and the decode actor stores them as they
    come: sending and receiving copy bytes, bit-exact (`encode` / `decode` exist for tests and tools). A head
    view of such a cache (`kv_transfer.head_view.QuantizedHeads`) ships its heads' data, then their scales:
    the cells of a cache of those heads."""

    lossy = False
    as_stored = True

    def __init__(self, wire: _ScaledCodec):
        self.wire = wire
        self.name = f"{wire.name}_cache"
        self.scale_layout = wire.scale_layout

    def scales_shape(self, shape):
        return self.wire.scales_shape(shape)

    def wire_dtype(self, dtype):
        return self.wire.wire_dtype(dtype)

    def _data_nbytes(self, shape) -> int:
        return math.prod(shape[2:])

    def payload_nbytes(self, shape, dtype):
        cell = self._data_nbytes(shape) + 4 * math.prod(self.scales_shape(shape)[2:])
        return shape[0] * shape[1] * cell

    def encode_from(self, kv_cache, layers, index, out, scratch=None):
        cells = out.view(layers[1] - layers[0], index.numel(), -1)
        if isinstance(kv_cache, torch.Tensor):
            torch.index_select(kv_cache[layers[0]:layers[1]], 1, index, out=cells)
            return
        start = 0
        for part in cell_parts(kv_cache):     # a head view: its heads' data, then their scales
            rows = torch.index_select(part[layers[0]:layers[1]], 1, index)
            width = rows[0, 0].numel()
            cells[..., start:start + width].copy_(rows.view(*cells.shape[:2], width))
            start += width

    def decode_into(self, payload, shape, kv_cache, layers, index, scratch=None):
        cells = payload.view(shape[0], shape[1], -1)
        if isinstance(kv_cache, torch.Tensor):
            write_blocks(kv_cache[layers[0]:layers[1]], index, cells)
            return
        start = 0
        for part in cell_parts(kv_cache):
            width = part[0, 0].numel()
            rows = cells[..., start:start + width].reshape(shape[0], shape[1], *part.shape[2:])
            part[layers[0]:layers[1]].index_copy_(1, index, rows)
            start += width

    def roundtrip(self, kv_cache, index):
        return None       # the blocks travel as stored: nothing changes

    def encode(self, x, out, scratch=None):
        shape = tuple(x.shape)
        staged = torch.empty(self.wire.payload_nbytes(shape, x.dtype), dtype=torch.uint8, device=x.device)
        self.wire.encode(x, staged, scratch)
        scales, data = self.wire._split(staged, shape, x.dtype)
        cells, split = out.view(shape[0], shape[1], -1), self._data_nbytes(shape)
        cells[..., :split].copy_(data.reshape(shape[0], shape[1], -1).view(torch.uint8))
        cells[..., split:].copy_(scales.reshape(shape[0], shape[1], -1).view(torch.uint8))

    def decode(self, payload, shape, dtype, scratch=None):
        cells, split = payload.view(shape[0], shape[1], -1), self._data_nbytes(shape)
        staged = torch.empty(self.wire.payload_nbytes(shape, dtype), dtype=torch.uint8, device=payload.device)
        scales, data = self.wire._split(staged, shape, dtype)
        data.view(torch.uint8).view(shape[0], shape[1], -1).copy_(cells[..., :split])
        scales.view(torch.uint8).view(shape[0], shape[1], -1).copy_(cells[..., split:])
        return self.wire.decode(staged, shape, dtype, scratch).clone()


CODECS: dict[str, Codec] = {codec.name: codec
                            for codec in (NoneCodec(), Fp8BlockCodec(), Int8TokenCodec(), Fp8TensorCodec(),
                                          StoredCodec(Fp8BlockCodec()), StoredCodec(Int8TokenCodec()))}


def stored_codec(cache_dtype: str) -> str:
    """The codec that ships a `kv_cache.dtype` cache's blocks as they are ("none" for the model dtype)."""
    return "none" if cache_dtype == "auto" else f"{cache_dtype}_cache"


def cache_dtype_of(codec: str) -> str:
    """The `kv_cache.dtype` a codec's payloads come from and go to."""
    return codec[:-len("_cache")] if codec.endswith("_cache") else "auto"


def wire_bytes_per_kv_byte(name: str, dtype_bytes: int, block_size: int, head_dim: int) -> float:
    """Bytes codec `name` puts on the wire per byte of a KV cache of `dtype_bytes`-byte values, scales
    included, for blocks of `block_size` tokens of `head_dim` values (the planner's and the simulator's
    link price): 1 for none; fp8 (1 + 4 / (block_size · head_dim)) / dtype_bytes; int8 (1 + 4 / head_dim) /
    dtype_bytes; a quantized cache's stored codecs (`fp8_cache`, `int8_cache`) 1: they ship the cache's own bytes."""
    if get_codec(name).as_stored:
        return 1.0
    dtype = {1: FP8, 2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    cell = (1, 1, 2, 1, block_size, head_dim)                  # [l, n, K/V, H, B, D]
    return get_codec(name).payload_nbytes(cell, dtype) / (math.prod(cell) * dtype_bytes)


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown KV codec {name!r}; expected one of {sorted(CODECS)}") from None
