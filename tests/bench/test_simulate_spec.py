"""The simulator's speculative decoding: the engine's own speculation, with a stand-in proposer and verifier."""
from __future__ import annotations

import math

import pytest

from bench.serving.workloads import make_workload
from bench.simulate import cli
from bench.simulate.hardware import Hardware
from bench.simulate.measured import MeasuredModel
from bench.simulate.models import model_config
from bench.simulate.plan_profile import performance_of
from bench.simulate.roofline import RooflineModel
from bench.simulate.run import simulate
from bench.simulate.sim_engine import SimEngine
from bench.simulate.sim_spec import speculation_for
from bench.simulate.step_time import Chunk, StepTimeModel
from deploy.config import load_config
from engine.args import EngineArgs
from engine.model.config import ModelConfig
from engine.model.presets import resolve_model
from engine.performance import MeasuredPerformance, Speculation
from engine.sampling.params import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.tokens_per_step import expected_tokens
from tests.sim_support import keep_built_cluster

TINY = ModelConfig.from_dir(resolve_model("tiny"))
LLAMA = model_config("llama-3-8b")
K = 4


class StepModel(StepTimeModel):
    """10 ms a step + 0.1 ms a token computed; `verify_s` more for a step that verifies any proposal."""

    name = "step"
    num_layers = 2
    kv_bytes_per_token = 4096

    def __init__(self, verify_s: float = 0.0):
        self.verify_s = verify_s

    def step_s(self, chunks):
        seconds = 0.010 + 1e-4 * sum(c.new_tokens for c in chunks)
        return seconds + (self.verify_s if any(c.proposals for c in chunks) else 0.0)

    def link_s(self, wire_bytes):
        return 1e-3 + wire_bytes / 1e9


def _engine(ratio: float | None, num_blocks: int = 4096, adaptive: bool = False) -> SimEngine:
    """A simulated engine alone; `ratio` None: no speculation, else k = 4 at that acceptance ratio."""
    args = EngineArgs(num_blocks=num_blocks, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
                      chunk_size=512)
    model = StepModel()
    if ratio is not None:
        args.speculative = SpecConfig("ngram", K, adaptive=adaptive)
        model = model.with_speculation(Speculation("ngram", K, ratio, adaptive))
    return SimEngine(args, TINY, model)


def _generate(engine: SimEngine, n: int, max_tokens: int):
    prompts = [[3 + (7 * i + j) % 200 for j in range(20 + i % 13)] for i in range(n)]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, seed=i) for i in range(n)]
    return engine.generate(prompts, params)


def test_a_verify_step_yields_the_modelled_tokens_and_output_is_the_targets_token_for_token():
    """Fixed k at acceptance ratio 0.6: the mean tokens per k-proposal verification is the model's
    (1 − α^(k+1)) / (1 − α) within 4 standard errors, the reported ratio is 0.6, and every request's output
    is exactly its max_tokens, token for token what the same engine produces without speculation."""
    engine = _engine(0.6)
    steps = []
    verified = engine.speculator.verified

    def record(req, num_proposed, num_accepted):
        steps.append((num_proposed, num_accepted))
        verified(req, num_proposed, num_accepted)
    engine.speculator.verified = record
    spec = _generate(engine, 48, 300)
    plain = _generate(_engine(None), 48, 300)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert all(len(c.token_ids) == 300 for c in spec)
    full = [1 + accepted for proposed, accepted in steps if proposed == K]
    assert len(full) > 4000 and len(full) > 0.9 * len(steps)      # (rooms cap only each request's last steps)
    mean = sum(full) / len(full)
    sd = math.sqrt(sum((t - mean) ** 2 for t in full) / (len(full) - 1))
    alpha = Speculation("ngram", K, 0.6).alpha
    assert abs(mean - expected_tokens(alpha, K)) < 4 * sd / math.sqrt(len(full))
    assert sum(t - 1 for t in full) / (K * len(full)) == pytest.approx(0.6, abs=0.02)
    engine.block_manager.check_no_leaks()


def test_rollback_and_preemption_leave_no_block_behind():
    """A pool too small for the batch: sequences are preempted and recomputed while verifying, rejected
    proposals' blocks are rolled back every step; the outputs are still the plain engine's, and every
    block is back in the pool."""
    engine = _engine(0.5, num_blocks=160)
    spec = _generate(engine, 24, 200)
    assert engine.scheduler.num_preemptions > 0
    assert engine.speculator.num_proposed > engine.speculator.num_accepted > 0
    assert [c.token_ids for c in spec] == [c.token_ids for c in _generate(_engine(None), 24, 200)]
    engine.block_manager.check_no_leaks()


def _config(method: str = "ngram", **extra):
    return load_config(None, {"model.name": "tiny", "speculative.method": method, **extra})


def _sim(cfg, model, specs, mode="colocated", rate=math.inf, seed=0, acceptance=0.6, counts=None):
    return simulate(cfg, model, TINY if isinstance(model, StepModel) else LLAMA, specs, rate=rate, mode=mode,
                    seed=seed, slo_ttft_s=1.0, slo_tpot_s=0.1, spec_acceptance=acceptance, counts=counts)


def _timings(run):
    return [(r.request_id, r.num_output_tokens, round(r.ttft_s, 9), round(r.e2e_s, 9)) for r in run.records]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_same_seed_same_run_every_request_complete_and_every_block_back(mode, monkeypatch):
    cfg = _config()
    specs = make_workload("mixed", 30, seed=1, scale=0.25)
    held = keep_built_cluster(monkeypatch)
    a = _sim(cfg, StepModel(), specs, mode, rate=20.0)
    assert [r.num_output_tokens for r in a.records] == [s.output_len for s in specs]
    for actor in held["cluster"].actors:
        actor.engine.block_manager.check_no_leaks()
        assert not actor.engine.requests
    speculators = [a.engine.speculator for a in held["cluster"].actors if a.role != "prefill"]
    assert speculators and all(s is not None for s in speculators)
    assert sum(s.num_accepted for s in speculators) > 0
    assert _timings(a) == _timings(_sim(cfg, StepModel(), specs, mode, rate=20.0))
    assert _timings(a) != _timings(_sim(cfg, StepModel(), specs, mode, rate=20.0, acceptance=0.3))


def _one_actor(cfg, model, n, prompt_len, output_len, acceptance=0.6):
    specs = make_workload("chat", n, seed=0, scale=1.0, prompt_len=prompt_len, output_len=output_len)
    return _sim(cfg, model, specs, acceptance=acceptance, counts={"prefill": 0, "decode": 1})


def test_the_turn_down_times_steps_on_the_virtual_clock_and_turns_a_losing_speculation_off(monkeypatch):
    """Verifying costs 30 ms more than a 10 ms step: the real turn-down, fed simulated seconds, settles on
    k = 0, and TPOT ends close to the run without speculation."""
    held = keep_built_cluster(monkeypatch)
    spec = _one_actor(_config(), StepModel(verify_s=0.030), 4, 64, 400, acceptance=0.5)
    turn_down = held["cluster"].actors[0].engine.speculator.turn_down
    bucket = (4).bit_length()          # (4 sequences decode together until their last step)
    seconds = {k: [s for _, s in window] for (b, k), window in turn_down.samples.items() if b == bucket}
    assert all(s > 0.040 for k, steps in seconds.items() if k for s in steps)       # simulated, not wall, time
    assert all(0.010 < s < 0.011 for s in seconds[0])
    assert max(range(K + 1), key=lambda k: turn_down.rate(bucket, k) or 0.0) == 0
    off = held["cluster"].actors[0].engine.speculator.num_steps_off
    plain = _one_actor(_config("off"), StepModel(verify_s=0.030), 4, 64, 400)
    assert off > 0.8 * held["cluster"].actors[0].num_steps
    assert spec.summary["tpot_p50_s"] == pytest.approx(plain.summary["tpot_p50_s"], rel=0.12)


def _h100():
    return RooflineModel(Hardware.load("H100-SXM"), LLAMA, model_name="llama-3-8b")


@pytest.mark.parametrize("adaptive", [False, True])
def test_tpot_where_speculation_pays_is_what_the_planner_predicts(adaptive):
    """llama-3-8b on an H100 at batch 4 (decode bound by reading the weights), acceptance 0.7 at k = 4.
    Fixed k: TPOT is `PerformanceModel.token_seconds`' prediction within 5 %, and falls from the plain run's
    by the factor it predicts over the plain step, within 5 %. Adaptive: the real turn-down measures every k
    first and chooses from noisy 8-step windows (here k = 3 in about 1 step of 6), so TPOT lies up to 15 %
    above the prediction, which takes the best k always, and never below it."""
    extra = {"speculative.adaptive": adaptive}
    n, prompt_len, output_len = 4, 128, 1500
    spec = _one_actor(_config(**extra), _h100(), n, prompt_len, output_len, acceptance=0.7)
    plain = _one_actor(_config("off"), _h100(), n, prompt_len, output_len)
    cfg = _config(**extra)
    model = performance_of(_h100(), LLAMA, cfg, speculation_for(cfg, LLAMA, acceptance=0.7))
    context = prompt_len + output_len / 2
    predicted = model.token_seconds(n, context)
    assert model.decode_step(n, context).num_tokens == K
    tpot, gain = spec.summary["tpot_p50_s"], spec.summary["tpot_p50_s"] / plain.summary["tpot_p50_s"]
    if adaptive:
        assert predicted < tpot < 1.15 * predicted
    else:
        assert tpot == pytest.approx(predicted, rel=0.05)
        assert gain == pytest.approx(predicted / model.decode_step_seconds(n, context), rel=0.05)
    assert gain < 0.3


def test_a_verify_row_reads_the_weights_once_and_scores_every_row():
    plain, verify = _h100().step_s([Chunk(1, 1000)] * 4), _h100().step_s([Chunk(1 + K, 1000 + K, K)] * 4)
    assert plain < verify < 1.05 * plain                    # memory-bound: the weights dominate
    flops = _h100().step_flops
    assert flops([Chunk(5, 1004, 4)]) - flops([Chunk(5, 1004)]) == pytest.approx(2.0 * 4 * _h100().costs.head_params)


def test_the_draft_methods_proposing_is_part_of_the_step():
    cfg = _config("draft", **{"speculative.draft.model": "pydoc-draft"})
    spec = speculation_for(cfg, LLAMA, acceptance=0.5)
    assert 0 < spec.draft_cost < 1e-3
    model, plain = _h100().with_speculation(spec), _h100()
    rows = [Chunk(1 + K, 500 + K, K)] * 8
    proposing = K * spec.draft_cost * plain.step_s([Chunk(1, 500)] * 8)
    assert model.step_s(rows) == pytest.approx(plain.step_s(rows) + proposing)
    ngram = _h100().with_speculation(speculation_for(_config(), LLAMA, acceptance=0.5))
    assert ngram.step_s(rows) == pytest.approx(plain.step_s(rows))


def test_a_measured_profile_prices_a_verify_step_from_its_speculative_points():
    costs = {"num_layers": 2, "hidden_size": 64, "attn_dim": 64, "layer_params": 100_000, "head_params": 10_000,
             "weight_bytes": 400_000, "kv_bytes_per_token": 512, "dtype_bytes": 4}
    decode = [{"batch": b, "context": 128, "seconds": 0.002 + 0.0002 * b, "bytes_per_s": 1e9} for b in (1, 8)]
    data = {"prefill": {"engine": {"costs": costs}, "points": [{"prompt_len": 128, "batch": 1, "seconds": 0.01}]},
            "decode": {"engine": {"costs": costs}, "points": decode},
            "speculative": {"method": "ngram", "num_tokens": K, "acceptance": {"ratio": 0.5, "num_tokens": K},
                            "points": [{**p, "num_tokens": K, "seconds": 2 * p["seconds"]} for p in decode]}}
    cfg = _config()
    speculation = speculation_for(cfg, TINY, data)            # the profile's own acceptance
    assert speculation.acceptance == 0.5
    model = MeasuredModel(MeasuredPerformance(data)).with_speculation(speculation)
    assert model.step_s([Chunk(1 + K, 128 + K, K)] * 8) == pytest.approx(2 * 0.0036)
    assert model.step_s([Chunk(1 + K, 128 + K, K)] * 8) == pytest.approx(model.profile.spec_step_seconds(8, 128, K))
    assert model.step_s([Chunk(1, 128)] * 8) == pytest.approx(0.0036)
    with pytest.raises(ValueError, match="--spec-acceptance"):
        speculation_for(cfg, TINY, {**data, "speculative": {**data["speculative"], "acceptance": None}})


def test_cli_prints_the_speculation_and_refuses_a_run_without_an_acceptance(capsys):
    base = ["--hardware", "H100-SXM", "--model", "llama-3-8b", "--workload", "chat", "--num-requests", "12",
            "--rate", "4"]
    assert cli.main([*base, "--compare", "colocated-chunked,colocated-spec"]) == 2
    assert "--spec-acceptance" in capsys.readouterr().err
    assert cli.main([*base, "--compare", "colocated-chunked,colocated-spec", "--spec-acceptance", "0.6"]) == 0
    out = capsys.readouterr()
    assert "speculative decoding (colocated-spec): ngram, k = 4 (adaptive), acceptance 0.60" in out.err
    assert "colocated-spec" in out.out
    assert cli.main([*base, "--spec-acceptance", "0.6"]) == 2          # speculation off in every variant
    assert "speculative.method" in capsys.readouterr().err
