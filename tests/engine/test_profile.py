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


def test_speculative_steps_propose_exactly_k_and_plain_steps_none(tiny_model_dir):
    """On an engine with speculation: a plain point verifies no proposal, a speculative one k per sequence and
    step; the speculator's counters and turn-down are as before, and every block is back."""
    from engine import Engine, EngineArgs
    from engine.profile import measure_decode
    from engine.spec.config import SpecConfig
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64, chunk_size=32,
                               speculative=SpecConfig("ngram", num_tokens=3)))
    spec = engine.speculator
    turn_down = spec.turn_down
    plain = measure_decode(engine, 2, 40, repeats=1)
    assert plain["num_proposed"] == 0 and "num_tokens" not in plain
    verify = measure_decode(engine, 2, 40, repeats=1, num_tokens=3)
    assert verify["num_tokens"] == 3 and verify["num_proposed"] == 2 * 2 * 3     # 2 steps (1 untimed) × 2 × k
    assert verify["seconds"] > 0 and verify["bytes"] == plain["bytes"]
    assert (spec.num_proposed, spec.num_accepted, spec.num_steps_off) == (0, 0, 0) and spec.turn_down is turn_down
    assert measure_decode(engine, 32, 40, num_tokens=3) is None                   # does not fit 64 blocks
    engine.block_manager.check_no_leaks()


def test_acceptance_on_held_out_text_and_the_draft_steps_on_pydoc(tiny_model_dir):
    """pydoc's held-out passages give each method's acceptance rate at k; the draft's step proposes k per
    sequence; nothing stays allocated in either cache."""
    from engine import Engine, EngineArgs
    from engine.model.presets import resolve_model
    from engine.profile import heldout_prompts, measure_acceptance, measure_decode, run_point
    from engine.spec.config import SpecConfig
    prompts = heldout_prompts(resolve_model("pydoc"), num=4)
    assert len(prompts) == 4 and all(len(p) == 128 for p in prompts)
    for method in ("ngram", "draft"):
        engine = Engine(EngineArgs("pydoc", dtype="float32", num_blocks=128, speculative=SpecConfig(
            method, num_tokens=4, draft_model="pydoc-draft" if method == "draft" else None)))
        found = measure_acceptance(engine, prompts, 4, max_tokens=12)
        assert found["proposed"] > 0 and 0.0 <= found["ratio"] <= 1.0 and found["num_tokens"] == 4
        assert found["ratio"] == found["accepted"] / found["proposed"]
        assert engine.speculator.num_proposed == 0
        if method == "draft":
            point = measure_decode(engine, 2, 64, repeats=1, num_tokens=4)
            assert point["num_proposed"] == 2 * 2 * 4
        engine.block_manager.check_no_leaks()
        assert engine.speculator.draft is None or engine.speculator.draft.block_manager.num_used_blocks == 0
    tiny = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=32, speculative=SpecConfig("ngram")))
    assert heldout_prompts(tiny.model_dir) is None
    assert run_point(tiny, {"kind": "acceptance", "num_tokens": 4}) is None     # no held-out text: nothing measured
