"""The workload section's histogram file (deploy/config/workload.py)."""
from __future__ import annotations

import pytest

from deploy.config import ConfigError, PDServeConfig, load_config


@pytest.mark.parametrize("name, text", [
    ("lengths.jsonl", '{"input_tokens": 100, "output_tokens": 10}\n\n'
                      '{"input_tokens": 400, "output_tokens": 30, "count": 3}\n'),
    ("lengths.csv", "input_tokens,output_tokens,count\n100,10,1\n400,30,3\n"),
])
def test_histogram_file_sets_the_means(tmp_path, write_yaml, name, text):
    (tmp_path / name).write_text(text)
    config = load_config(write_yaml(f"workload: {{histogram_file: {name}}}\n"))
    assert (config.workload.input_tokens_mean, config.workload.output_tokens_mean) == (325, 25)
    assert PDServeConfig.model_validate(config.model_dump()) == config  # round trip


@pytest.mark.parametrize("name, text, problem", [
    ("bad.jsonl", '{"input_tokens": 100, "output_tokens": 10}\nnot json\n',
     "bad.jsonl:2: invalid JSON"),
    ("bad.csv", "input_tokens,output\n1,2\n", "bad.csv:1: CSV header lacks output_tokens"),
    ("neg.csv", "input_tokens,output_tokens\n1,2\n-3,4\n", "neg.csv:3: input_tokens must be"),
    ("empty.jsonl", "\n", "empty.jsonl: no rows"),
])
def test_bad_histogram_names_file_and_line(tmp_path, write_yaml, name, text, problem):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(f"workload: {{histogram_file: {name}}}\n"))
    assert str(info.value).startswith("workload.histogram_file: ")
    assert problem in str(info.value)


def test_histogram_and_means_conflict(tmp_path, write_yaml):
    (tmp_path / "h.csv").write_text("input_tokens,output_tokens\n10,20\n")
    path = write_yaml("workload: {histogram_file: h.csv, input_tokens_mean: 99}\n")
    with pytest.raises(ConfigError, match=r"^workload\.input_tokens_mean: cannot be combined"):
        load_config(path)
