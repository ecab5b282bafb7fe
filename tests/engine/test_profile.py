"""engine.profile: prefill and decode measured through the engine's own steps, counted by the cost model."""
from __future__ import annotations


def test_measurements_on_a_tiny_engine(tiny_model_dir):
    from engine import Engine, EngineArgs
    from engine.profile import engine_costs, measure_decode, measure_prefill
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64, chunk_size=32))
    pre = measure_prefill(engine, 100)
    assert pre["flops"] == engine_costs(engine).prefill_flops(100) and pre["seconds"] > 0
    dec = measure_decode(engine, 4, 100, repeats=1)
    costs = engine_costs(engine)
    assert dec["bytes"] == costs.weight_bytes + 4 * 100 * costs.kv_bytes_per_token
    assert measure_decode(engine, 64, 100) is None                      # does not fit 64 blocks
    engine.block_manager.check_no_leaks()
