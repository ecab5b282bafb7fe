"""Per-machine kernel choices: the faster alternative wins, the result is cached on disk by machine and
shapes and reused, and the engine applies the weight-layout choice."""
from __future__ import annotations

import json

import pytest
import torch

from engine import kernel_choice


def _timer(seconds: dict[str, float], calls: list[str]):
    def timer(fn):
        calls.append(fn.label)
        return seconds[fn.label]
    return timer


def _candidates(*labels: str) -> dict:
    out = {}
    for label in labels:
        def fn() -> None:
            return None
        fn.label = label
        out[label] = fn
    return out


def test_the_faster_candidate_wins_and_is_cached(tmp_path):
    path = str(tmp_path / "choices.json")
    calls: list[str] = []
    pick = kernel_choice.choose("layout", (64, 128), _candidates("a", "b"),
                                timer=_timer({"a": 2e-3, "b": 1e-3}, calls), path=path)
    assert pick == "b" and calls == ["a", "b"]
    (entry,) = json.loads(open(path).read()).values()
    assert entry["choice"] == "b" and entry["seconds"] == {"a": 2e-3, "b": 1e-3}
    assert entry["machine"] == kernel_choice.machine_key() and entry["shapes"] == "(64, 128)"
    # the same machine and shapes: read back, nothing timed (even if timings would now say otherwise)
    assert kernel_choice.choose("layout", (64, 128), _candidates("a", "b"),
                                timer=_timer({"a": 1e-4, "b": 1e-3}, calls), path=path) == "b"
    assert calls == ["a", "b"]
    # other shapes or another choice: measured on their own, both kept
    assert kernel_choice.choose("layout", (64, 256), _candidates("a", "b"),
                                timer=_timer({"a": 1e-4, "b": 1e-3}, calls), path=path) == "a"
    assert kernel_choice.choose("attention", (64, 128), _candidates("a", "b"),
                                timer=_timer({"a": 5e-3, "b": 1e-3}, calls), path=path) == "b"
    assert calls == ["a", "b"] * 3 and len(json.loads(open(path).read())) == 3


def test_a_broken_cache_file_is_measured_again(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text("{not json")
    calls: list[str] = []
    assert kernel_choice.choose("x", (1,), _candidates("a", "b"), timer=_timer({"a": 1.0, "b": 2.0}, calls),
                                path=str(path)) == "a"
    assert calls == ["a", "b"] and len(json.loads(path.read_text())) == 1


def test_the_machine_key_names_cpu_and_torch():
    key = kernel_choice.machine_key()
    assert torch.__version__ in key and "threads" not in key      # one choice for every process of a machine
    assert kernel_choice.cpu_identity() in key


@pytest.mark.parametrize("decode_s,prefill_s,input_major", [
    ((2.0, 1.0), (1.00, 1.02), True),       # (row-major, input-major): faster decode, prefill within 3%
    ((2.0, 1.0), (1.00, 1.10), False),      # faster decode but 10% slower prefill: row-major
    ((1.0, 2.0), (1.00, 0.90), False),      # slower decode: row-major
], ids=["input-major", "prefill-too-slow", "decode-slower"])
def test_engine_applies_the_measured_weight_layout(tiny_model_dir, tmp_path, monkeypatch, decode_s, prefill_s,
                                                   input_major):
    """Stubbed timings per operation (batch-1 GEMV, 256-row GEMM) and layout; the engine's weights follow."""
    from engine import Engine
    monkeypatch.setenv(kernel_choice.CACHE_ENV, str(tmp_path / "choices.json"))

    def timer(fn):                              # fn: partial(_linears, layer weights in one layout, inputs)
        weights, inputs = fn.args
        times = decode_s if inputs[0].shape[0] == 1 else prefill_s
        return times[0] if weights[0].is_contiguous() else times[1]
    monkeypatch.setattr(kernel_choice, "best_time", timer)
    engine = Engine(tiny_model_dir, dtype="float32", num_blocks=16, attention="eager")
    weight = engine.model.layers[0].qkv_proj.weight
    assert weight.is_contiguous() is not input_major
    entries = sorted(json.loads((tmp_path / "choices.json").read_text()).values(), key=lambda e: e["name"])
    assert [e["name"] for e in entries] == ["weight_layout/decode_gemv", "weight_layout/prefill_gemm"]
    assert entries[0]["seconds"] == dict(zip(("row-major", "input-major"), decode_s))
