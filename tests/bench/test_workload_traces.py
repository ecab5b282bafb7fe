"""Reading a `--workload FILE.jsonl` trace (bench.serving.workloads): what is refused, and how."""
import re

import pytest

from bench.serving.workloads import MAX_TRACE_TOKENS, MULTI_TURN, WORKLOADS, make_conversations, make_workload


def trace(tmp_path, text, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e400"])
def test_a_non_finite_length_is_refused_naming_file_line_and_key(tmp_path, value):
    path = trace(tmp_path, '{"prompt_len": 4, "output_len": 2}\n' f'{{"prompt_len": {value}, "output_len": 5}}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:2: prompt_len must be a finite whole number"):
        make_workload(path, 2)
    path = trace(tmp_path, f'{{"prompt_len": 4, "output_len": {value}}}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1: output_len must be a finite"):
        make_workload(path, 2)


@pytest.mark.parametrize("row, key, shown", [
    ('{"prompt_len": 2.7, "output_len": 5}', "prompt_len", "2.7"),
    ('{"prompt_len": 4, "output_len": 0.5}', "output_len", "0.5"),
    ('{"prompt_len": true, "output_len": 5}', "prompt_len", "true"),
    ('{"prompt": "hi", "output_len": false}', "output_len", "false"),
    ('{"prompt_len": [3], "output_len": 5}', "prompt_len", "[3]"),
    ('{"prompt_len": "3.5", "output_len": 5}', "prompt_len", "'3.5'"),
])
def test_a_length_that_is_not_a_whole_number_is_refused(tmp_path, row, key, shown):
    path = trace(tmp_path, row + "\n")
    message = rf"trace\.jsonl:1: {key} must be a whole number of tokens, got {re.escape(shown)}$"
    with pytest.raises(ValueError, match=message):
        make_workload(path, 1)


def test_a_whole_float_is_a_length(tmp_path):
    specs = make_workload(trace(tmp_path, '{"prompt_len": 5.0, "output_len": 3.0}\n'), 1)
    assert specs[0].prompt_len == 5 and specs[0].output_len == 3 and isinstance(specs[0].output_len, int)


@pytest.mark.parametrize("row, key", [('{"prompt_len": 1e9, "output_len": 5}', "prompt_len"),
                                      ('{"prompt_len": 4, "output_len": 100000000000}', "output_len")])
def test_an_absurd_length_is_refused_naming_the_limit(tmp_path, row, key):
    path = trace(tmp_path, "\n" + row + "\n")
    with pytest.raises(ValueError, match=rf"trace\.jsonl:2: {key} is [\d,]+ tokens, above the limit of "
                                         rf"{MAX_TRACE_TOKENS:,}"):
        make_workload(path, 1)


def test_a_length_below_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"trace\.jsonl:1: output_len must be at least 1, got 0"):
        make_workload(trace(tmp_path, '{"prompt_len": 4, "output_len": 0}\n'), 1)


def test_an_override_above_the_limit_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--prompt-len must be at most"):
        make_workload("chat", 1, prompt_len=MAX_TRACE_TOKENS + 1)
    with pytest.raises(ValueError, match="--output-len must be at most"):
        make_workload("chat", 1, output_len=MAX_TRACE_TOKENS + 1)
    with pytest.raises(ValueError, match="--output-len must be at most"):
        make_conversations(1, 2, output_len=MAX_TRACE_TOKENS + 1)
    with pytest.raises(ValueError, match="--scale"):
        make_workload("rag", 1, scale=1e6)
    assert make_workload("chat", 1, prompt_len=7, output_len=3)[0].prompt_len == 7


def test_the_extension_is_matched_in_any_case(tmp_path):
    specs = make_workload(trace(tmp_path, '{"prompt_len": 4, "output_len": 2}\n', "TRACE.JSONL"), 2)
    assert [(s.prompt_len, s.output_len) for s in specs] == [(4, 2), (4, 2)]


def test_a_missing_trace_file_says_so(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=f"--workload {missing}: cannot read it: no such file$"):
        make_workload(missing, 1)


@pytest.mark.parametrize("name", ["trace.json", "trace.csv"])
def test_a_path_that_is_not_a_jsonl_trace_is_not_an_unknown_workload(tmp_path, name):
    path = tmp_path / name
    with pytest.raises(ValueError, match="no such file.*JSON Lines") as refused:
        make_workload(str(path), 1)
    assert "unknown workload" not in str(refused.value)
    path.write_text('{"prompt_len": 4, "output_len": 2}\n')
    with pytest.raises(ValueError, match=r"not a \.jsonl file; trace files are JSON Lines"):
        make_workload(str(path), 1)
    with pytest.raises(ValueError, match="no such file"):
        make_workload(str(tmp_path / "dir" / "trace"), 1)


def test_an_unknown_workload_lists_every_name_the_commands_accept():
    with pytest.raises(ValueError, match="unknown workload 'chatt'") as refused:
        make_workload("chatt", 1)
    for name in (*WORKLOADS, MULTI_TURN, "FILE.jsonl"):
        assert name in str(refused.value)


def test_a_bad_line_names_the_file_and_line(tmp_path):
    with pytest.raises(ValueError, match=r"trace\.jsonl:2: not valid JSON"):
        make_workload(trace(tmp_path, '{"prompt_len": 4, "output_len": 2}\n{"prompt_len": 4,\n'), 1)
    with pytest.raises(ValueError, match=r"trace\.jsonl:1: not a JSON object"):
        make_workload(trace(tmp_path, "[4, 2]\n"), 1)
    with pytest.raises(ValueError, match=r"trace\.jsonl:1: need prompt or prompt_len, and output_len"):
        make_workload(trace(tmp_path, '{"prompt_len": 4}\n'), 1)


def test_a_short_trace_is_repeated_and_a_long_one_cut_saying_so(tmp_path, capsys):
    rows = "".join(f'{{"prompt_len": {n}, "output_len": 2}}\n' for n in (3, 4, 5))
    path = trace(tmp_path, rows)
    specs = make_workload(path, 7)
    assert [s.prompt_len for s in specs] == [3, 4, 5, 3, 4, 5, 3]
    assert capsys.readouterr().err == f"workload {path}: 3 requests, repeated to 7\n"
    assert [s.prompt_len for s in make_workload(path, 2)] == [3, 4]
    assert capsys.readouterr().err == f"workload {path}: first 2 of 3 requests used\n"
    assert len(make_workload(path, 3)) == 3
    assert capsys.readouterr().err == ""
