"""`pdserve plan` from a profile file: JSON and the ledger table."""
from __future__ import annotations

import json

from profile_support import synthetic


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
