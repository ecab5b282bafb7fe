"""Smoke test of the transfer benchmark: one loopback pair end to end, every field of its JSON.

No timing assertions: the targets are judged in docs/benchmarks/transfer.md from full runs.
"""
from __future__ import annotations

import json
import math

from bench import transfer as bench_transfer  # the entry `pdserve bench transfer` imports

RECORD_KEYS = {"link", "transport", "codec", "payload_mib", "effective_gbps", "wire_bytes", "encode_gbps",
               "decode_gbps"}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_transfer_loopback_reports_every_figure(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    argv = ["--quick", "--transports", "torch", "--codecs", "none,fp8", "--links", "loopback", "--reps", "1",
            "--json", str(out)]
    assert bench_transfer.main(argv) == 0
    result = json.loads(out.read_text())
    base = result["baselines"]
    assert all(_positive(base[key]) for key in ("memcpy_gbps", "socket_gbps", "socket_tuned_gbps", "socket_plain_gbps"))
    # the faster loop is the reference
    assert base["socket_gbps"] == max(base["socket_tuned_gbps"], base["socket_plain_gbps"])
    records = result["records"]
    assert not result["notes"], result["notes"]
    assert {(r["codec"], r["payload_mib"]) for r in records} == {(c, p) for c in ("none", "fp8") for p in (1.0, 16.0)}
    for record in records:
        assert set(record) == RECORD_KEYS and record["link"] == "loopback" and record["transport"] == "torch"
        assert all(_positive(record[key]) for key in ("effective_gbps", "wire_bytes", "encode_gbps", "decode_gbps"))
    wire = {(r["codec"], r["payload_mib"]): r["wire_bytes"] for r in records}
    assert wire[("fp8", 16.0)] <= 0.52 * wire[("none", 16.0)]  # scales included
    assert "loopback  torch" in capsys.readouterr().out
