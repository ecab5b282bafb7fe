"""Simulations side by side (`--jobs`): the same results as one at a time, in the order asked."""
from __future__ import annotations

import json
import math
import os

import pytest

from bench.simulate import cli, parallel


@pytest.mark.parametrize("sweep", [
    ["--workload", "chat", "--num-requests", "40", "--sweep", "rate", "--compare", "colocated,disaggregated",
     "--sweep-values", "5,40,400"],
    ["--workload", "rag", "--num-requests", "24", "--sweep", "split", "--devices", "3", "--sweep-values", "2,8"],
    ["--num-requests", "12", "--sweep", "ratio", "--sweep-values", "200:20,1500:20"],
    ["--workload", "mixed", "--num-requests", "30", "--rate", "20", "--compare", "colocated,disaggregated,auto"],
], ids=["rate", "split", "ratio", "compare"])
def test_runs_side_by_side_give_what_one_at_a_time_gives(sweep, tmp_path):
    results = []
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}.json"
        assert cli.main(["--hardware", "H100-SXM", "--model", "llama-2-7b", *sweep, "--jobs", jobs,
                         "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        result.pop("wall_s", None)           # (wall time: the only figure that differs)
        results.append(result)
    assert results[0] == results[1]


def test_map_runs_keeps_the_order_and_reports_what_went_wrong():
    values = list(range(1, 40))
    with parallel.jobs(2):
        assert parallel.map_runs(math.factorial, values) == [math.factorial(v) for v in values]
        with pytest.raises(ValueError, match="invalid literal"):       # a run's own error, as it was raised
            parallel.map_runs(int, ["1", "x", "3"])
    with pytest.raises(parallel.WorkerLost, match="lower --jobs"), parallel.jobs(2):
        parallel.map_runs(os._exit, [3, 4])                             # the workers die mid-run
    assert parallel.map_runs(str, [1, 2]) == ["1", "2"]                 # outside `jobs`: here, one at a time


def test_a_bad_jobs_flag_is_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        cli.main(["--jobs", "0"])
    assert refused.value.code == 2
    assert "argument --jobs: must be at least 1, got 0" in capsys.readouterr().err
