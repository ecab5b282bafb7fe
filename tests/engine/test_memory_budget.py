"""KV budget from the device (engine/kv_cache/memory_budget.py), with the device memory query stubbed."""
from __future__ import annotations

import logging

import pytest
import torch

from engine.kv_cache import memory_budget
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.kv_cache.memory_budget import GIB, MIB, compute_budget, measure_kv_budget, profiling_batch
from engine.model.presets import resolve_model

PER_BLOCK = 2 * MIB


def test_budget_is_the_fraction_less_weights_activations_and_reserve():
    b = compute_budget(total=80 * GIB, free=60 * GIB, fraction=0.9, weights=16 * GIB, activations=2 * GIB,
                       bytes_per_block=PER_BLOCK)
    reserve = int(0.02 * 80 * GIB)                          # 2% of 80 GiB is more than the 512 MiB floor
    expected_kv = int(0.9 * 80 * GIB) - 16 * GIB - 2 * GIB - reserve
    assert b.reserve == reserve
    assert b.num_blocks == expected_kv // PER_BLOCK and b.kv == b.num_blocks * PER_BLOCK
    assert (b.total, b.weights, b.activations, b.limited_by_free) == (80 * GIB, 16 * GIB, 2 * GIB, False)
    line = b.log_line()
    for part in ("device 80.00 GiB × 0.9", "weights 16.00 GiB", "activations 2.00 GiB", f"{b.num_blocks} blocks",
                 "reserve 1.60 GiB", "limited by memory_fraction 0.9"):
        assert part in line, line


def test_small_device_keeps_the_reserve_floor():
    b = compute_budget(total=4 * GIB, free=4 * GIB, fraction=1.0, weights=GIB, activations=0,
                       bytes_per_block=PER_BLOCK)
    assert b.reserve == 512 * MIB
    assert b.kv == 4 * GIB - GIB - 512 * MIB


def test_memory_other_processes_hold_limits_the_budget():
    """A second actor on the same GPU: the fraction would allow more than the device has free."""
    b = compute_budget(total=80 * GIB, free=30 * GIB, fraction=0.9, weights=16 * GIB, activations=2 * GIB,
                       bytes_per_block=PER_BLOCK, reserve=GIB)
    assert b.limited_by_free and b.num_blocks == (30 * GIB - 2 * GIB - GIB) // PER_BLOCK
    assert "limited by free memory" in b.log_line()


def test_no_room_for_a_block_names_the_key():
    with pytest.raises(ValueError, match=r"kv_cache\.memory_fraction: no room for one KV block .*weights 7\.00 GiB"):
        compute_budget(total=8 * GIB, free=8 * GIB, fraction=0.9, weights=7 * GIB, activations=GIB // 2,
                       bytes_per_block=PER_BLOCK)


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, "0.9", True, None])
def test_bad_fraction_names_the_key(fraction):
    with pytest.raises(ValueError, match=r"kv_cache\.memory_fraction: must be a number in \(0, 1\]"):
        compute_budget(total=GIB, free=GIB, fraction=fraction, weights=0, activations=0, bytes_per_block=PER_BLOCK)


@pytest.mark.parametrize("tokens, seqs, chunk, max_len, expected", [
    (2048, 64, 512, 4096, [512] * 4),
    (1000, 64, 512, 4096, [512, 488]),
    (5000, 2, 512, 4096, [512, 512]),        # max_num_seqs caps the batch
    (100, 64, None, 4096, [100]),            # no chunking: one prompt of the whole budget
    (100, 64, None, 64, [64, 36]),           # never longer than the context
])
def test_profiling_batch_is_the_largest_step(tokens, seqs, chunk, max_len, expected):
    assert profiling_batch(tokens, seqs, chunk, max_len) == expected


def test_profiling_batch_refuses_an_empty_step():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        profiling_batch(0, 8, 512, 4096)


class StubMemory:
    """A device that reports fixed figures: `weights` held, the profiling cache adds `cache`, the pass
    peaks `activations` above both; records the order of the calls."""

    def __init__(self, total, free, weights, cache, activations):
        self.total, self.free, self.weights, self.cache, self.activations = total, free, weights, cache, activations
        self.calls: list[str] = []

    def total_and_free(self):
        self.calls.append("total_and_free")
        return self.total, self.free

    def allocated(self):
        self.calls.append("allocated")
        return self.weights if self.calls.count("allocated") == 1 else self.weights + self.cache

    def reset_peak(self):
        self.calls.append("reset_peak")

    def peak_allocated(self):
        self.calls.append("peak_allocated")
        return self.weights + self.cache + self.activations

    def release_cached(self):
        self.calls.append("release_cached")


class RecordingModel(torch.nn.Module):
    """The real model; records what each forward pass was given."""

    def __init__(self, model):
        super().__init__()
        self.model, self.seen = model, []

    def forward(self, input_ids, positions, kv_cache, meta, logit_rows):
        logits = self.model(input_ids, positions, kv_cache, meta, logit_rows)
        self.seen.append((input_ids.numel(), positions.tolist(), kv_cache.shape, logit_rows.tolist(), logits.shape))
        return logits


def test_measure_runs_the_largest_step_and_reads_the_device(caplog):
    model_dir = resolve_model("tiny")
    cfg = ModelConfig.from_dir(model_dir)
    model = RecordingModel(load_model(model_dir, cfg, torch.device("cpu"), torch.float32, 256))
    memory = StubMemory(total=24 * GIB, free=20 * GIB, weights=3 * GIB, cache=5 * MIB, activations=GIB)
    with caplog.at_level(logging.INFO, logger="pdserve.engine.kv_cache.memory_budget"):
        budget = measure_kv_budget(model, cfg, device=torch.device("cpu"), dtype=torch.float32, block_size=16,
                                   fraction=0.5, max_num_batched_tokens=200, max_num_seqs=8, chunk_size=64,
                                   max_model_len=256, memory=memory)

    (tokens, positions, cache_shape, rows, logits_shape), = model.seen   # one pass: 64 + 64 + 64 + 8 tokens
    assert tokens == 200 and positions == [*range(64)] * 3 + [*range(8)]
    assert rows == [63, 127, 191, 199] and logits_shape == (4, cfg.vocab_size)
    assert cache_shape == (cfg.num_hidden_layers, 4 + 4 + 4 + 1, 2, cfg.num_key_value_heads, 16, cfg.head_dim)
    # weights before the profiling cache, activations above it; the device read after the cache is released
    assert memory.calls == ["release_cached", "allocated", "allocated", "reset_peak", "peak_allocated",
                            "release_cached", "total_and_free"]
    per_block = cfg.kv_bytes_per_token(4) * 16
    assert (budget.weights, budget.activations, budget.bytes_per_block) == (3 * GIB, GIB, per_block)
    assert budget.num_blocks == (12 * GIB - 3 * GIB - GIB - 512 * MIB) // per_block
    line, = [r.getMessage() for r in caplog.records if r.name == "pdserve.engine.kv_cache.memory_budget"]
    assert line.startswith("KV budget: device 24.00 GiB × 0.5") and "(profiled: 4 sequences, 200 tokens)" in line


def test_measure_checks_the_fraction_before_touching_the_device():
    memory = StubMemory(GIB, GIB, 0, 0, 0)
    with pytest.raises(ValueError, match=r"kv_cache\.memory_fraction"):
        measure_kv_budget(None, None, device=torch.device("cpu"), dtype=torch.float32, block_size=16, fraction=2.0,
                          max_num_batched_tokens=8, max_num_seqs=1, chunk_size=None, max_model_len=8, memory=memory)
    assert memory.calls == []


def test_cpu_engine_keeps_its_explicit_budget():
    """kv_memory_fraction is for CUDA devices; a CPU engine allocates num_blocks as before."""
    from engine import Engine, EngineArgs
    engine = Engine(EngineArgs("tiny", num_blocks=37, kv_memory_fraction=0.9, attention="eager"))
    assert engine.block_manager.num_blocks == 37 and engine.kv_cache.shape[1] == 37
    assert engine.kv_budget is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_query_reads_the_device():
    memory = memory_budget.CudaMemory(torch.device("cuda"))
    total, free = memory.total_and_free()
    assert 0 < free <= total and memory.allocated() >= 0
