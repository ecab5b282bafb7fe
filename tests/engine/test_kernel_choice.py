"""Per-machine kernel choices: the faster alternative wins, the result is cached on disk by machine and
shapes and reused, and the engine applies the weight-layout choice."""
from __future__ import annotations

import json

import pytest
import torch

from engine.model import kernel_choice


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


# seconds per layout (row-major, input-major, onednn-packed): decode at 1, 8 and 32 rows, then prefill
_PACKED_AT_8_AND_32 = ((1.0, 0.9, 1.1), (1.0, 1.1, 0.5), (1.0, 1.1, 0.5))


@pytest.mark.parametrize("decode_s,prefill_s,memory,layout", [
    (((2.0, 1.0, 3.0),) * 3, (1.00, 1.02, 1.0), 1 << 40, "input-major"),   # faster decode, prefill within 3%
    (((2.0, 1.0, 3.0),) * 3, (1.00, 1.10, 1.2), 1 << 40, "row-major"),     # faster decode, prefill 10% slower
    (((1.0, 2.0, 1.5),) * 3, (1.00, 0.90, 0.9), 1 << 40, "row-major"),     # slower decode
    (((1.0, 0.9, 0.6),) * 3, (1.00, 1.0, 1.05), 1 << 40, "input-major"),   # packed decodes faster, prefill 5% slower
    (_PACKED_AT_8_AND_32, (1.00, 1.0, 0.95), 1 << 40, "onednn-packed+input-major"),   # each where it is faster
    (_PACKED_AT_8_AND_32, (1.00, 1.0, 0.95), 1 << 20, "onednn-packed"),    # no room for a second copy
], ids=["input-major", "prefill-too-slow", "decode-slower", "packed-prefill-too-slow", "both-copies",
        "packed-no-room"])
def test_engine_applies_the_measured_weight_layout(tiny_model_dir, tmp_path, monkeypatch, decode_s, prefill_s,
                                                   memory, layout):
    """Stubbed timings per operation (decode GEMMs of 1, 8, 32 rows, a 256-row GEMM) and layout; the engine's
    weights follow, and its outputs stay the row-major engine's."""
    from engine import Engine, EngineArgs, SamplingParams
    from engine.model.linear import ONEDNN_PACKED, layouts_for
    if ONEDNN_PACKED not in layouts_for(torch.zeros(1)):
        pytest.skip("oneDNN cannot pack float32 weights here")
    monkeypatch.setenv(kernel_choice.CACHE_ENV, str(tmp_path / "choices.json"))
    monkeypatch.setattr(kernel_choice, "_physical_memory", lambda: memory)
    rows = {1: 0, 8: 1, 32: 2}

    def timer(fn):                              # fn: partial(_linears, layout, layer weights by layout, inputs)
        if fn.func is kernel_choice._products:      # the dense copy against packed at a few rows
            return 1.0 if fn.args[2] else 0.5
        layout, weights, inputs = fn.args
        which = 2 if weights(layout)[0].is_mkldnn else 0 if weights(layout)[0].is_contiguous() else 1
        n = inputs()[0].shape[0]
        return decode_s[rows[n]][which] if n in rows else prefill_s[which]
    monkeypatch.setattr(kernel_choice, "best_time", timer)
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=16, attention="eager"))
    assert engine.model.weight_layout == layout
    assert {m.layout for m in (engine.model.layers[0].qkv_proj, engine.model.lm_head)} == {layout}
    entries = json.loads((tmp_path / "choices.json").read_text()).values()
    chosen = [e for e in entries if e["name"] != "weight_layout/dense_rows"]
    assert sorted(e["name"] for e in chosen) == ["weight_layout/decode"] * 3 + ["weight_layout/prefill"]
    assert all(set(e["seconds"]) == {"row-major", "input-major", "onednn-packed"} for e in chosen)
    assert len(entries) - len(chosen) == (layout == "onednn-packed+input-major")    # packed won at 2 rows
    assert engine.model.layers[0].qkv_proj.dense_rows == 1
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [c.token_ids for c in engine.generate(prompts, params)] == \
        [c.token_ids for c in _row_major(tiny_model_dir).generate(prompts, params)]


def _row_major(model_dir):
    from engine import Engine, EngineArgs
    from engine.model.linear import ROW_MAJOR
    return Engine(EngineArgs(model_dir, dtype="float32", num_blocks=16, attention="eager", weight_layout=ROW_MAJOR))


@pytest.mark.parametrize("dense_s,packed_s,rows", [
    ((1.0, 1.0, 1.0, 1.0), (2.0, 2.0, 2.0, 2.0), 16),      # the dense copy wins everywhere
    ((1.0, 1.5, 3.0, 6.0), (1.2, 1.4, 2.0, 3.0), 4),       # a tie within the slack keeps it; 8 rows go packed
    ((1.3, 1.5, 3.0, 6.0), (1.0, 1.4, 2.0, 3.0), 1),       # packed clearly faster at 2 rows
])
def test_the_dense_copy_serves_products_up_to_the_measured_crossover(tmp_path, monkeypatch, dense_s, packed_s, rows):
    """`dense_rows`: the most rows (2, 4, 8, 16) up to which the dense copy of a packed-with-GEMV layer is not
    `DENSE_SLACK` slower than packed; the engine's layers then take it for those products."""
    from engine.model.linear import ONEDNN_PACKED, PACKED_WITH_GEMV, Linear, layouts_for
    if ONEDNN_PACKED not in layouts_for(torch.zeros(1)):
        pytest.skip("oneDNN cannot pack float32 weights here")
    monkeypatch.setenv(kernel_choice.CACHE_ENV, str(tmp_path / "choices.json"))
    at = {2: 0, 4: 1, 8: 2, 16: 3}

    def timer(fn):                              # fn: partial(_products, layers, inputs, dense)
        _, inputs, dense = fn.args
        return (dense_s if dense else packed_s)[at[inputs[0].shape[0]]]
    monkeypatch.setattr(kernel_choice, "best_time", timer)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj = (Linear(32, 48), Linear(16, 32),
                                                                              Linear(32, 64), Linear(32, 32))
            for m in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj):
                m.store(PACKED_WITH_GEMV)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer()])
    assert kernel_choice.dense_rows(Model()) == rows


@pytest.mark.parametrize("layout", ["onednn-packed", "onednn-packed+input-major"])
def test_packed_weights_match_dense(layout):
    """Packed alone frees the dense weight; with the GEMV copy, 1-row products go through that copy
    (bit-equal to F.linear on it) and the rest through the packed one; all equal F.linear to rounding."""
    from engine.model.linear import ONEDNN_PACKED, Linear, layouts_for, linear
    if ONEDNN_PACKED not in layouts_for(torch.zeros(1)):
        pytest.skip("oneDNN cannot pack float32 weights here")
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=True)
    dense_w, dense_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.store(layout)
    assert layer.layout == layout
    assert layer.weight.numel() == (0 if layout == "onednn-packed" else dense_w.numel())
    with torch.inference_mode():
        for rows in (0, 1, 7, 32, 300):
            x = torch.randn(rows, 48)
            out = layer(x)
            torch.testing.assert_close(out, torch.nn.functional.linear(x, dense_w, dense_b), rtol=1e-5, atol=1e-5)
            via = layer.weight if rows == 1 and layout != ONEDNN_PACKED else layer.packed
            assert torch.equal(out, linear(x, via, layer.bias))
    if layout != ONEDNN_PACKED:                 # up to `dense_rows` rows through the dense copy
        layer.dense_rows = 8
        with torch.inference_mode():
            for rows, via in ((7, layer.weight), (8, layer.weight), (9, layer.packed)):
                x = torch.randn(rows, 48)
                assert torch.equal(layer(x), linear(x, via, layer.bias))
    with pytest.raises(RuntimeError, match="already packed"):
        layer.store(layout)


def test_an_unavailable_layout_is_refused_by_name(tiny_model_dir):
    from engine import Engine, EngineArgs
    with pytest.raises(ValueError, match="weight_layout 'sideways' is not available .* choose one of auto, row-major"):
        Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=16, attention="eager", weight_layout="sideways"))
