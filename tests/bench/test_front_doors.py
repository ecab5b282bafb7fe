"""`python -m bench.serving.front_doors`: both front doors of a router over the paced backend, every
request answered in full through each, figures written for both."""
from __future__ import annotations

import json

from bench.serving.front_doors import main


def test_front_doors_bench_runs_both_doors(tmp_path, capsys):
    out = tmp_path / "doors.json"
    rc = main(["--concurrency", "2", "--requests", "4", "--output-len", "5", "--first-token-ms", "5",
               "--token-ms", "2", "--json", str(out)])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]["2"]
    for door in ("grpc", "openai"):
        assert runs[door]["requests"] == 4
        assert runs[door]["ttft_p50_ms"] >= 5.0          # never before the backend's first token
        # every request ends no sooner than the backend's last token (5 ms + 4 × 2 ms); TPOT alone has no
        # such floor: a first token the client reads late leaves the rest to arrive closer together
        assert runs[door]["ttft_mean_ms"] + 4 * runs[door]["tpot_mean_ms"] >= 13.0
    assert "openai-grpc" in capsys.readouterr().out
