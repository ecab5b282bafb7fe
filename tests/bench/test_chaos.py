"""The chaos run at small scale: `pdserve bench chaos` with 80 requests.

2 prefill + 2 decode actors (tiny model, float32, half a CPU each) serve seeded, stop-string
requests while every drill fires once, each when its victim has requests in flight: an admission
burst, kill -9 of a prefill actor, a stalled, a corrupted and a dropped KV transfer, kill -9 of a
decode actor mid-stream, a hung decode loop; client cancels and deadlines throughout. Each test
asserts one of the chaos run's targets against the run's figures (printed with the report; `pytest -s`).
"""
from __future__ import annotations

import json

import pytest

N = 80
FLAGS = ["--num-requests", str(N), "--concurrency", "8", "--burst", "24", "--rounds", "1",
         "--max-prompt-tokens", "160", "--max-tokens", "40", "--max-queue", "4", "--max-batch-size", "8",
         "--num-blocks", "128", "--safety-deadline-s", "40", "--no-progress"]


@pytest.fixture(scope="module")
def chaos(tiny_model_dir, tmp_path_factory) -> dict:
    from bench.chaos import main
    out = tmp_path_factory.mktemp("chaos") / "chaos.json"
    assert main(["--model", tiny_model_dir, *FLAGS, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    print("chaos figures:", json.dumps({k: v for k, v in report["figures"].items() if k != "statuses"}))
    return report


def test_every_drill_fired_and_the_service_recovers(chaos):
    fg = chaos["figures"]
    assert fg["drills_skipped"] == [] and fg["drills_fired"] == 7
    assert fg["sent"] == N and fg["served_after"]


def test_no_request_hangs(chaos):
    fg = chaos["figures"]
    assert fg["hung"] == 0, [r for r in chaos["records"] if r["verdict"] == "hung"]


def test_no_kv_block_leaks_on_any_actor(chaos):
    fg = chaos["figures"]
    assert fg["actors_missing_from_stats"] == []
    assert fg["leaked_blocks"] == 0, fg["blocks_used_after"]
    assert fg["router_accounting_left"] == {}


def test_no_corrupted_response(chaos):
    assert chaos["figures"]["corrupted"] == 0, [r for r in chaos["records"] if r["verdict"] == "corrupted"]


def test_fault_hit_requests_complete_exactly_the_rest_a_clear_status(chaos):
    fg = chaos["figures"]
    assert fg["fault_hit_server"] > 0
    misses = [r for r in chaos["records"] if r["hit"] and r["verdict"] != "exact"]
    assert fg["fault_hit_exact"] >= 0.99 * fg["fault_hit"], misses
    assert all(r["verdict"] == "clear" for r in misses), misses


def test_the_burst_goes_beyond_admission_and_is_shed_fast(chaos):
    fg = chaos["figures"]           # its admitted requests are judged with the fault-hit ones above
    assert fg["burst_resource_exhausted"] > 0 and fg["fault_hit_burst"] > 0
    assert fg["burst_reject_max_s"] < 5.0


def test_client_cancels_and_deadlines_end_exactly_or_with_a_clear_status(chaos):
    fg = chaos["figures"]
    assert fg["cancel_cancelled"] > 0 and fg["deadline_exceeded"] > 0
    others = [r for r in chaos["records"] if r["category"] in ("cancel", "deadline")
              and r["verdict"] not in ("exact", "clear")]
    assert fg["cancel_other"] == 0 and fg["deadline_other"] == 0, others


def test_dead_peer_detected_within_two_seconds(chaos):
    fg = chaos["figures"]
    detected = fg["detect_kill_prefill_s"] + fg["detect_kill_decode_s"]
    assert len(detected) == 2 and all(d is not None and d <= 2.0 for d in detected), detected
