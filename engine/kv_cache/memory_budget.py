"""KV cache size from the device's memory (CUDA), measured the way vLLM sizes its cache.

On a GPU the KV cache takes what the weights and the largest step's activations leave of the
actor's share of the device, so a fixed size either wastes an H100 or runs a small card out of
memory. After the weights are loaded, one profiling forward pass runs at the largest batch the
scheduler can form (``max_num_batched_tokens`` prompt tokens, in chunk-sized sequences, one logits
row each), and the cache gets::

    kv = memory_fraction × total − weights − peak activations − reserve

where weights are the bytes torch holds on the device before the pass, activations the peak the
pass allocated on top of them and of its own small KV cache, and the reserve covers what torch's
allocator does not count (CUDA context, cuBLAS/NCCL workspaces) and fragmentation. The KV also
never exceeds what the device has free after the pass (less the activations and the reserve), so
memory other processes hold (a second actor on the same GPU) is respected. The table of the four
terms goes to the log in one line at start-up.

CPU keeps an explicit budget (``num_blocks`` / ``kv_cache_gib``): this module is only used for
CUDA devices. The device query is a small protocol (:class:`DeviceMemory`), so the computation is
tested on CPU with a stubbed query.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.model.attention import build_metadata

log = logging.getLogger(f"pdserve.{__name__}")

MIB = 1 << 20
GIB = 1 << 30
RESERVE_MIN_BYTES = 512 * MIB      # at least this much is kept back (CUDA context, workspaces)
RESERVE_FRACTION = 0.02            # of the device's total memory, when that is more
FRACTION_KEY = "kv_cache.memory_fraction"


class DeviceMemory(Protocol):
    """What the budget reads from the device (torch.cuda's allocator and the driver)."""

    def total_and_free(self) -> tuple[int, int]:
        """(total, free) bytes of the device, as the driver reports them (all processes)."""

    def allocated(self) -> int:
        """Bytes torch's allocator holds for live tensors of this process."""

    def reset_peak(self) -> None:
        """Start a new peak measurement of allocated bytes."""

    def peak_allocated(self) -> int:
        """Most bytes allocated at once since the last reset_peak."""

    def release_cached(self) -> None:
        """Wait for the device, then hand the allocator's cached, unused blocks back to the driver."""


class CudaMemory:
    """DeviceMemory of one CUDA device through torch.cuda."""

    def __init__(self, device: torch.device):
        self.device = device

    def total_and_free(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return total, free

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass(frozen=True, slots=True)
class KVBudget:
    """The budget table of one actor's device, in bytes (``num_blocks`` is a count)."""

    total: int                 # the device's memory
    fraction: float            # memory_fraction: this actor's share of `total`
    weights: int               # torch's bytes on the device before the profiling pass
    activations: int           # the profiling pass's peak on top of the weights
    reserve: int               # context, workspaces, fragmentation
    free: int                  # the device's free bytes after the pass (all processes)
    kv: int                    # bytes given to KV blocks (num_blocks × bytes_per_block)
    bytes_per_block: int
    num_blocks: int
    limited_by_free: bool      # True when other memory on the device, not the fraction, set the size

    def log_line(self) -> str:
        def gib(n: int) -> str:
            return f"{n / GIB:.2f} GiB"
        limit = "free memory on the device (other processes hold some)" if self.limited_by_free else \
            f"memory_fraction {self.fraction:g}"
        return (f"KV budget: device {gib(self.total)} × {self.fraction:g} = {gib(int(self.fraction * self.total))}: "
                f"weights {gib(self.weights)}, activations {gib(self.activations)} (profiled), "
                f"KV {gib(self.kv)} = {self.num_blocks} blocks of {self.bytes_per_block / MIB:.3f} MiB, "
                f"reserve {gib(self.reserve)}; device free after profiling {gib(self.free)}; limited by {limit}")


def check_fraction(fraction: float) -> float:
    """The fraction, or ValueError naming the key when it is not in (0, 1]."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"{FRACTION_KEY}: must be a number in (0, 1], got {fraction!r}")
    return float(fraction)


def reserve_bytes(total: int) -> int:
    return max(RESERVE_MIN_BYTES, int(RESERVE_FRACTION * total))


def compute_budget(total: int, free: int, fraction: float, weights: int, activations: int,
                   bytes_per_block: int, reserve: int | None = None) -> KVBudget:
    """The budget table from measured figures (pure: no device).

    Args:
        total: the device's memory; free: what it has free after the profiling pass, with the
            pass's cached blocks released (the weights are still held).
        fraction: memory_fraction, this actor's share of ``total``.
        weights: bytes torch holds before the pass; activations: the pass's peak above that.
        bytes_per_block: KV bytes of one block over all layers, K and V.
        reserve: kept back for what the allocator does not count; default ``reserve_bytes(total)``.
    Raises:
        ValueError naming kv_cache.memory_fraction when not even one block fits, with the table.
    """
    fraction = check_fraction(fraction)
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    reserve = reserve_bytes(total) if reserve is None else reserve
    by_fraction = int(fraction * total) - weights - activations - reserve
    by_free = free - activations - reserve
    kv = max(min(by_fraction, by_free), 0)
    num_blocks = kv // bytes_per_block
    budget = KVBudget(total, fraction, weights, activations, reserve, free, num_blocks * bytes_per_block,
                      bytes_per_block, num_blocks, by_free < by_fraction)
    if num_blocks < 1:
        raise ValueError(f"{FRACTION_KEY}: no room for one KV block ({bytes_per_block} bytes) — {budget.log_line()}. "
                         f"Raise {FRACTION_KEY}, lower the batch (pools.prefill.max_batch_tokens), free the device, "
                         "or set kv_cache.num_blocks / memory_gib")
    return budget


def profiling_batch(max_num_batched_tokens: int, max_num_seqs: int, chunk_size: int | None,
                    max_model_len: int) -> list[int]:
    """Sequence lengths of the largest step the scheduler can form: chunk-sized prompt pieces
    filling max_num_batched_tokens, at most max_num_seqs of them."""
    if max_num_batched_tokens < 1 or max_num_seqs < 1:
        raise ValueError(f"max_num_batched_tokens and max_num_seqs must be >= 1, "
                         f"got {max_num_batched_tokens} and {max_num_seqs}")
    longest = max(min(chunk_size or max_num_batched_tokens, max_model_len, max_num_batched_tokens), 1)
    lengths = []
    left = max_num_batched_tokens
    while left > 0 and len(lengths) < max_num_seqs:
        lengths.append(min(longest, left))
        left -= lengths[-1]
    return lengths


def profiling_cache(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, seq_lens: list[int],
                    device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A KV cache just big enough for fresh prompts of ``seq_lens`` tokens."""
    blocks = sum(math.ceil(n / block_size) for n in seq_lens)
    return torch.zeros(num_layers, blocks, 2, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)


@torch.inference_mode()
def profile_forward(model, cache: torch.Tensor, seq_lens: list[int], vocab_size: int) -> None:
    """One forward pass over fresh prompts of ``seq_lens`` tokens (one logits row each) into ``cache``."""
    device, block_size = cache.device, cache.shape[4]
    seqs, first = [], 0
    for n in seq_lens:
        nb = math.ceil(n / block_size)
        seqs.append((0, n, list(range(first, first + nb))))
        first += nb
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (sum(seq_lens),), generator=generator).to(device)
    positions = torch.cat([torch.arange(n) for n in seq_lens]).to(device)
    rows = torch.tensor(list(_cumsum(seq_lens)), dtype=torch.long, device=device) - 1
    meta = build_metadata(seqs, block_size, device)
    model(input_ids, positions, cache, meta, rows)


def _cumsum(values: list[int]):
    total = 0
    for v in values:
        total += v
        yield total


def measure_kv_budget(model, cfg, *, device: torch.device, dtype: torch.dtype, block_size: int, fraction: float,
                      max_num_batched_tokens: int, max_num_seqs: int, chunk_size: int | None, max_model_len: int,
                      memory: DeviceMemory | None = None, bytes_per_block: int | None = None) -> KVBudget:
    """Profile the loaded ``model`` (config ``cfg``: an engine ModelConfig) on ``device`` and
    return its KV budget; logs the table in one line.

    ``memory`` is the device query (default: :class:`CudaMemory` of ``device``); tests pass a stub.
    ``bytes_per_block``: what one block takes in the cache (a quantized cache's; default: ``dtype``'s).
    """
    fraction = check_fraction(fraction)
    memory = memory or CudaMemory(device)
    seq_lens = profiling_batch(max_num_batched_tokens, max_num_seqs, chunk_size, max_model_len)
    memory.release_cached()
    weights = memory.allocated()
    cache = profiling_cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, seq_lens,
                            device, dtype)
    before = memory.allocated()             # weights + the profiling cache, which is KV, not activations
    memory.reset_peak()
    profile_forward(model, cache, seq_lens, cfg.vocab_size)
    activations = max(memory.peak_allocated() - before, 0)
    del cache
    memory.release_cached()
    total, free = memory.total_and_free()
    budget = compute_budget(total, free, fraction, weights, activations,
                            bytes_per_block or cfg.kv_bytes_per_token(dtype.itemsize) * block_size)
    log.info("%s (profiled: %d sequences, %d tokens)", budget.log_line(), len(seq_lens), sum(seq_lens))
    return budget
