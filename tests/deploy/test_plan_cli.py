"""`pdserve plan` from a profile file: JSON and the ledger table."""
from __future__ import annotations

import json

import pytest

from profile_support import synthetic, with_degree, with_speculation


def test_plan_cli_json_from_profile_file(tmp_path, tiny_model_dir, capsys):
    from deploy.cli import main
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(synthetic()))
    rc = main(["plan", "--model", tiny_model_dir, "--profile", str(path), "--json",
               "--set", "kv_cache.num_blocks=4096", "--set", "workload.arrival_rate_rps=3"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_prefill"] >= 1 and out["n_decode"] >= 1 and out["ledger"]["kv_bytes_per_token"] == 4096
    rc = main(["plan", "--model", tiny_model_dir, "--profile", str(path)])
    table = capsys.readouterr().out
    assert rc == 0 and "prefill FLOPs per request" in table and "decode actors (needed → planned)" in table


def test_plan_devices_searches_parallelism_and_prints_the_runner_up(tmp_path, tiny_model_dir, capsys):
    from deploy.cli import main
    from deploy.config import load_config
    from deploy.plan_cli import ParallelismSearch, search_for
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(synthetic()))
    flags = ["--model", tiny_model_dir, "--profile", str(path), "--set", "kv_cache.num_blocks=4096",
             "--set", "workload.arrival_rate_rps=3", "--set", "slo.ttft_p99_ms=5000", "--devices", "6", "--tp", "1,2"]
    assert main(["plan", *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = load_config(None, {"model.name": tiny_model_dir, "kv_cache.num_blocks": 4096,
                             "workload.arrival_rate_rps": 3, "slo.ttft_p99_ms": 5000})
    found = search_for(cfg, synthetic(), ParallelismSearch(6, (1, 2)))
    assert [c["goodput_per_device"] for c in out["candidates"]] == [c.goodput_per_device for c in found[:2]]
    assert all(c["devices"] <= 6 for c in out["candidates"]) and len(out["candidates"]) == 2
    assert main(["plan", *flags]) == 0
    text = capsys.readouterr().out
    best = found[0]
    assert f"chosen   : prefill TP {best.prefill_degree} × {best.n_prefill}, decode TP {best.decode_degree}" in text
    assert "runner-up: prefill TP" in text


def test_plan_devices_says_which_degrees_were_measured(tmp_path, tiny_model_dir, capsys):
    from deploy.cli import main
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(with_degree(synthetic(), 2, pools=("decode",), step=lambda b, c: 0.004 + 0.0003 * b)))
    flags = ["--model", tiny_model_dir, "--profile", str(path), "--set", "kv_cache.num_blocks=4096",
             "--set", "workload.arrival_rate_rps=3", "--set", "slo.ttft_p99_ms=5000", "--devices", "6", "--tp", "1,2"]
    assert main(["plan", *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["measured_degrees"] == {"prefill": [1], "decode": [1, 2]}
    assert main(["plan", *flags]) == 0
    text = capsys.readouterr().out
    assert "prefill measured at TP 1; other degrees predicted" in text
    assert "decode measured at TP 1, 2; other degrees predicted" in text


def test_plan_sizes_decode_at_the_acceptance_given_else_measured_else_without_a_speed_up(tmp_path, tiny_model_dir,
                                                                                       capsys):
    from deploy.cli import main
    measured = tmp_path / "spec.json"
    measured.write_text(json.dumps(with_speculation(synthetic(), lambda b, c: 0.012 + 0.0018 * b + 1e-6 * b * c,
                                                    acceptance=0.5)))
    old = tmp_path / "old.json"
    old.write_text(json.dumps(synthetic()))
    flags = ["--model", tiny_model_dir, "--json", "--set", "kv_cache.num_blocks=4096",
             "--set", "workload.arrival_rate_rps=3"]

    def planned(*more: str) -> dict:
        assert main(["plan", *flags, *more]) == 0
        return json.loads(capsys.readouterr().out)["decode"]
    off = planned("--profile", str(measured))
    at_measured = planned("--profile", str(measured), "--speculative-method", "ngram")
    given = planned("--profile", str(measured), "--speculative-method", "ngram", "--spec-acceptance", "0.8")
    unknown = planned("--profile", str(old), "--speculative-method", "ngram")
    assert off["speculation"] == {} and unknown["speculation"]["acceptance"] == 0.0
    assert (at_measured["speculation"]["acceptance"], given["speculation"]["acceptance"]) == (0.5, 0.8)
    assert off["tokens_per_s_per_actor"] < at_measured["tokens_per_s_per_actor"] < given["tokens_per_s_per_actor"]
    assert unknown["tokens_per_s_per_actor"] == off["tokens_per_s_per_actor"]
    table = [f for f in flags if f != "--json"]
    assert main(["plan", *table, "--profile", str(measured), "--speculative-method", "ngram",
                 "--spec-acceptance", "0.8"]) == 0
    assert "speculative decoding (ngram, acceptance 0.80)" in capsys.readouterr().out
    assert main(["plan", *flags, "--profile", str(measured), "--spec-acceptance", "1.5"]) == 2
    assert "--spec-acceptance 1.5: an acceptance rate" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--devices", "0"], "--devices 0: the number of devices to plan for, at least 1"),
    (["--devices", "4", "--tp", "a,b"], "--tp a,b: a comma-separated list of positive degrees, e.g. 1,2,4"),
    (["--devices", "4", "--tp", "0"], "--tp 0: a comma-separated list of positive degrees, e.g. 1,2,4"),
    (["--devices", "4", "--tp", ""], "--tp : a comma-separated list of positive degrees, e.g. 1,2,4"),
    (["--devices", "4", "--allreduce-us", "-5"], "--allreduce-us -5: a finite latency in µs, at least 0"),
    (["--devices", "4", "--allreduce-gbps", "0"], "--allreduce-gbps 0: a finite bandwidth in GB/s, above 0"),
    (["--devices", "4", "--allreduce-gbps", "nan"], "--allreduce-gbps nan: a finite bandwidth in GB/s, above 0"),
])
def test_plan_search_flags_out_of_range_are_one_line_and_exit_2(tmp_path, tiny_model_dir, capsys, flags, message):
    from deploy.cli import main
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(synthetic()))
    assert main(["plan", "--model", tiny_model_dir, "--profile", str(path), *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("flags, message", [
    (["--tp", "1,2"], "--tp: tunes the parallelism search, which needs --devices N"),
    (["--allreduce-gbps", "50"], "--allreduce-gbps: tunes the parallelism search, which needs --devices N"),
    (["--spec-acceptance", "0.8"], "--spec-acceptance 0.8: sizes speculative decoding, which is off (turn it on "
     "with --speculative-method ngram|draft or config speculative.method)"),
])
def test_plan_flags_that_would_change_nothing_are_refused(tmp_path, tiny_model_dir, capsys, flags, message):
    from deploy.cli import main
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(synthetic()))
    assert main(["plan", "--model", tiny_model_dir, "--profile", str(path), *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
