"""`pdserve simulate`'s command line: flags that contradict each other, runs that could not answer, and
outputs that could not be written are refused before any run, naming the flag; results are strict JSON."""
from __future__ import annotations

import json
import os

import pytest

from bench.simulate import cli

GPU = ["--hardware", "H100-SXM", "--model", "llama-3-8b"]


@pytest.mark.parametrize("argv, said", [
    (["--hardware", "H100-SXM", "--profile", "p.json"], "--profile times a measured host and --hardware"),
    (["--hardware", " "], "--hardware: give a GPU name or a YAML file"),
    (["--model", "llama-3-70b"], "--model applies with --hardware"),
    (["--dtype", "fp8"], "--dtype applies with --hardware"),
    (["--intra-node"], "--intra-node applies with --hardware"),
    ([*GPU, "--devices", "4"], "--devices applies with --sweep split"),
    ([*GPU, "--tp", "1,2", "--sweep", "rate"], "--tp applies with --sweep split"),
    ([*GPU, "--top", "3"], "--top applies with --sweep split"),
    ([*GPU, "--sweep-values", "1,2"], "--sweep-values applies with --sweep"),
    ([*GPU, "--plot", "plots"], "--plot applies with --sweep rate or split"),
    ([*GPU, "--sweep", "ratio", "--plot", "plots"], "--plot applies with --sweep rate or split"),
    ([*GPU, "--autoscale-interval", "0.001"], "--autoscale-interval 0.001: at least 0.05 s"),
    ([*GPU, "--rate", "1e-300", "--num-requests", "20"], "--rate 1e-300 with --num-requests 20 spreads the arrivals"),
    ([*GPU, "--num-requests", "1000000000"], "--num-requests 1,000,000,000: at most 10,000,000"),
    ([*GPU, "--rate", "0.001", "--num-requests", "100"], "about 1e+05 simulated seconds (at most 86,400"),
    ([*GPU, "--sweep", "rate", "--rate", "3"], "--rate does not apply to --sweep rate: it runs each variant at rates"),
    ([*GPU, "--sweep", "split", "--compare", "auto"], "--compare does not apply to --sweep split"),
    ([*GPU, "--sweep", "split", "--mode", "auto"], "--mode does not apply to --sweep split"),
    ([*GPU, "--sweep", "ratio", "--workload", "rag"], "--workload does not apply to --sweep ratio: it runs chat"),
    ([*GPU, "--sweep", "ratio", "--scale", "0.5"], "--scale does not apply to --sweep ratio"),
    ([*GPU, "--sweep", "ratio", "--prompt-len", "100"], "--prompt-len does not apply to --sweep ratio"),
    ([*GPU, "--workload", "chat", "--num-turns", "3"], "--num-turns applies with --workload multi-turn"),
    ([*GPU, "--workload", "multi-turn", "--prompt-len", "30"], "--prompt-len does not apply to --workload multi"),
    ([*GPU, "--workload", "structured"], "--workload structured: the simulator does not model grammar-constrained"),
    ([*GPU, "--sweep", "split", "--tensor-parallel", "2"], "--tensor-parallel does not apply to --sweep split"),
    ([*GPU, "--json", ""], "--json: give a file name"),
    ([*GPU, "--mode", "colocated", "--compare", "disaggregated"], "--mode runs one variant and --compare several"),
    ([*GPU, "--sweep", "rate", "--plot", " "], "--plot: give a directory name"),
    ([*GPU, "--set", "routing.kv_events_interval_s=1e-5"], "routing.kv_events_interval_s: must be >= 0.01"),
])
def test_a_flag_the_run_would_ignore_or_never_finish_is_refused(argv, said, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert said in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "plots")


def test_a_trace_takes_no_scale(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_len": 10, "output_len": 5}\n')
    assert cli.main([*GPU, "--workload", str(trace), "--scale", "2"]) == 2
    assert f"--scale does not apply to a trace (--workload {trace})" in capsys.readouterr().err


def test_an_output_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    if os.path.isdir("/proc/self"):       # a directory that takes no new file, even from root
        assert cli.main([*GPU, "--num-requests", "2", "--json", "/proc/pdserve-out.json"]) == 2
        assert "--json /proc/pdserve-out.json: cannot write it" in capsys.readouterr().err
    existing = tmp_path / "kept.json"
    existing.write_text("{}")
    assert cli.main([*GPU, "--num-requests", "2", "--json", str(existing), "--devices", "2"]) == 2
    assert existing.read_text() == "{}"        # probed, not truncated, by a run that never started
    capsys.readouterr()
    assert cli.main([*GPU, "--num-requests", "2", "--sweep", "rate", "--plot", str(not_a_dir)]) == 2
    assert f"--plot {not_a_dir}: not a directory" in capsys.readouterr().err
    assert cli.main([*GPU, "--num-requests", "2", "--sweep", "rate", "--plot", str(not_a_dir / "sub")]) == 2
    assert "cannot make the directory" in capsys.readouterr().err
    out = tmp_path / "new.json"
    assert cli.main([*GPU, "--set", "model.max_model_len=300", "--workload", "chat", "--json", str(out)]) == 2
    assert sorted(os.listdir(tmp_path)) == ["file", "kept.json"]    # the probe of a new --json leaves nothing


def test_a_workload_past_the_models_context_is_refused_with_its_count(capsys):
    assert cli.main([*GPU, "--set", "model.max_model_len=300", "--workload", "chat", "--num-requests", "40"]) == 2
    err = capsys.readouterr().err
    assert "--workload chat:" in err and "of 40 requests need more tokens" in err
    assert "than the model's context of 300" in err
    assert cli.main([*GPU, "--set", "model.max_model_len=300", "--workload", "multi-turn", "--num-requests", "3"]) == 2
    assert "3 of 3 conversations (their last turn)" in capsys.readouterr().err


def test_the_result_file_is_strict_json_with_null_for_nan_and_inf(tmp_path, capsys):
    out = tmp_path / "run.json"
    # every request at once (rate inf), with an SLO no request meets: nan-free figures, and rate null
    assert cli.main([*GPU, "--workload", "chat", "--num-requests", "4", "--json", str(out)]) == 0
    text = out.read_text()
    assert "Infinity" not in text and "NaN" not in text

    def refuse(constant):
        raise AssertionError(f"non-strict JSON constant {constant}")
    data = json.loads(text, parse_constant=refuse)
    assert data["rate"] is None and data["runs"]["disaggregated"]["completed"] == 4


def test_a_run_says_why_its_requests_failed(tmp_path, capsys, caplog):
    """A GPU whose memory leaves a KV pool smaller than a chat request: the router refuses them, as it would
    a client's, and the run's line says how many and why (the router's warning per failed request is left out)."""
    import yaml
    hardware = yaml.safe_load(open(os.path.join(os.path.dirname(cli.__file__), "hardware", "H100-SXM.yaml")))
    hardware["memory_bytes"] = 19.0e9          # llama-3-8b's 16 GB of weights leave 18 blocks of 16 tokens
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(hardware))
    assert cli.main(["--hardware", str(path), "--model", "llama-3-8b", "--workload", "chat", "--num-requests", "6",
                     "--rate", "5"]) == 0
    err = capsys.readouterr().err
    assert "disaggregated @ 5 req/s: 6 of 6 requests failed, e.g. RequestError: RESOURCE_EXHAUSTED: request needs" \
        in err
    assert not [r for r in caplog.records if r.name == "pdserve.router" and "request_" in r.getMessage()]


def test_a_profile_of_another_model_is_refused(tmp_path, capsys):
    """A profile file names no model, only the shape it measured: timing the config's model by another's
    profile is refused, naming what differs."""
    from bench.simulate.hardware import Hardware
    from bench.simulate.plan_profile import profile_of
    from bench.simulate.roofline import RooflineModel
    from deploy.config import load_config
    from engine.model.config import ModelConfig
    from engine.model.presets import resolve_model
    own = load_config(None).model.name
    other = "small" if own != "small" else "tiny"
    shape = ModelConfig.from_dir(resolve_model(other))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_of(RooflineModel(Hardware.load("H100-SXM"), shape), shape, (128, 256), ())))
    assert cli.main(["--profile", str(path), "--workload", "chat", "--scale", "0.5", "--num-requests", "4"]) == 2
    assert f"measured another model (?) than the config's model.name {own}: num_layers" in capsys.readouterr().err
    assert cli.main(["--profile", str(path), "--set", f"model.name={other}", "--workload", "chat", "--scale", "0.5",
                     "--num-requests", "4"]) == 0


def test_progress_is_drawn_on_a_terminal_by_default_and_counts_wall_seconds(capsys, monkeypatch):
    argv = [*GPU, "--num-requests", "20", "--rate", "1", "--jobs", "1"]
    assert cli.main(argv) == 0                          # stderr not a terminal: no progress
    assert "[####" not in capsys.readouterr().err
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert cli.main(argv) == 0                          # a terminal: one line, redrawn
    err = capsys.readouterr().err
    assert "\r" in err and "20/20 (0 failed)" in err
    last = err.split("20/20 (0 failed) ")[1].split("s")[0]
    assert int(last) < 15                               # wall seconds, not the ~20 simulated ones
    assert cli.main([*argv, "--no-progress"]) == 0
    assert "[####" not in capsys.readouterr().err


def test_the_configs_cache_dtype_and_quantization_reach_the_simulated_gpus(tmp_path):
    """An fp8 cache ships its own bytes (no more than bf16 blocks encoded to fp8, never twice) and int4 weights
    make decode faster; both were once left out of a roofline run."""
    def run(*settings: str) -> dict:
        out = tmp_path / "run.json"
        sets = [x for s in settings for x in ("--set", s)]
        assert cli.main([*GPU, "--workload", "chat", "--num-requests", "6", "--rate", "5", "--jobs", "1", *sets,
                         "--json", str(out)]) == 0
        return json.loads(out.read_text())["runs"]["disaggregated"]
    bf16, fp8, int4 = run(), run("kv_cache.dtype=fp8"), run("model.quantization=int4")
    assert fp8["kv_bytes"] == pytest.approx(bf16["kv_bytes"] / 2)
    assert fp8["kv_wire_bytes"] <= bf16["kv_wire_bytes"]
    assert int4["tpot_p50_s"] < bf16["tpot_p50_s"] / 2


def test_a_variant_runs_as_named_and_the_slo_flags_are_the_clusters(tmp_path):
    """`disaggregated` ships KV whatever routing.mode the file sets, and auto placement and the autoscaler aim at
    the SLOs the report judges by."""
    conf = tmp_path / "colocated.yaml"
    conf.write_text("routing:\n  mode: colocated\n")
    args = cli.with_defaults(cli.build_parser().parse_args(["--config", str(conf), "--slo-ttft-ms", "40",
                                                            "--slo-tpot-ms", "7"]))
    cfg = cli.variant_config(args, "disaggregated")
    assert cfg.routing.mode == "disaggregated" and (cfg.slo.ttft_p99_ms, cfg.slo.tpot_p99_ms) == (40, 7)
    assert cli.variant_config(args, "auto").routing.mode == "auto"


def test_the_clients_deadline_ends_a_request_as_a_grpc_clients_does(tmp_path):
    """--timeout is each request's deadline: past it the request ends DEADLINE_EXCEEDED (it used to run on)."""
    out = tmp_path / "run.json"
    assert cli.main([*GPU, "--workload", "chat", "--num-requests", "20", "--timeout", "1.5", "--jobs", "1",
                     "--json", str(out)]) == 0
    run = json.loads(out.read_text())["runs"]["disaggregated"]
    assert 0 < run["failed"] < 20 and run["e2e_p99_s"] <= 1.5


def test_every_variant_is_checked_before_any_runs_and_the_header_names_each_ones_degrees(capsys):
    assert cli.main([*GPU, "--num-requests", "4", "--rate", "5", "--compare", "colocated,auto",
                     "--tensor-parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert "tensor-parallel actors do not change role" in err and "colocated @" not in err    # no run first
    assert cli.main([*GPU, "--num-requests", "4", "--rate", "5", "--compare", "colocated,disaggregated", "--jobs", "1",
                     "--set", "pools.prefill.tensor_parallel=4", "--set", "pools.decode.tensor_parallel=2"]) == 0
    assert "; colocated: prefill tp=2, decode tp=2; disaggregated: prefill tp=4, decode tp=2" in capsys.readouterr().err


def test_a_multi_turn_rate_sweep_counts_conversations_per_second_throughout(tmp_path, capsys):
    """--rate is conversations a second for multi-turn: the sweep's capacity, its rates and its burst check are
    too (the capacity was turns/s, three times the conversations here, then offered as conversations/s)."""
    from bench.serving.workloads import make_conversations
    conversations = make_conversations(8, 3, 0, 1.0, None)
    assert cli.per_arrival(conversations) == 3 and cli.rate_unit(conversations) == "conversations/s"
    out = tmp_path / "sweep.json"
    assert cli.main([*GPU, "--workload", "multi-turn", "--num-requests", "8", "--num-turns", "3", "--jobs", "1",
                     "--sweep", "rate", "--json", str(out)]) == 0
    captured, result = capsys.readouterr(), json.loads(out.read_text())
    assert "disaggregated capacity @ inf conversations/s" in captured.err
    assert "disaggregated: max rate at >= 90% SLO attainment" in captured.out
    assert captured.out.split("max rate at >= 90% SLO attainment")[1].split("\n")[0].split()[1] == "conversations/s"
    # every point completes its conversations' 3 turns: turns/s never exceeds 3 x the conversations/s offered
    # by more than the run's tail allows; offered in turns/s (the old unit) they would sit near 1 x
    lowest = min(result["points"]["disaggregated"], key=lambda p: p["x"])
    assert lowest["request_throughput_rps"] > 1.2 * lowest["x"]


def test_json_keeps_each_requests_record_and_when_each_flip_happened(tmp_path):
    out = tmp_path / "auto.json"
    assert cli.main([*GPU, "--workload", "mixed", "--num-requests", "200", "--rate", "25", "--mode", "auto",
                     "--jobs", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    records, summary = result["records"]["auto"], result["runs"]["auto"]
    assert len(records) == 200 and sum(r["ok"] for r in records) == summary["completed"]
    assert sum(r["meets_slo"] for r in records) / 200 == pytest.approx(summary["slo_attainment"])
    assert sum(r["num_output_tokens"] for r in records if r["ok"]) == sum(r["output_len"] for r in records if r["ok"])
    assert all("itl_s" not in r for r in records)
    flips = result["flips"]["auto"]
    assert flips and all({"at_s", "seconds", "drain_s", "handed_off"} <= set(f) for f in flips)
    assert all(0 < f["at_s"] <= result["runs"]["auto"]["duration_s"] + 60 for f in flips)
