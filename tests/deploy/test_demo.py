"""`pdserve demo`'s report: the stage table built from a real router timeline, texts printed as text,
the legend, no escape sequences (the whole demo against a cluster: tests/cluster/test_demo_cli.py)."""
from __future__ import annotations

import re

from deploy.demo import HEADER, LEGEND, TTFT_PARTS, Completion, StageRow, render_completion, render_report
from proto.pdserve.v1 import generation_pb2 as pb
from router.timing import STAGE_NAMES, Timeline

NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def _timing(ttft_s: float = 0.150, e2e_s: float = 0.770, timeline: bool = True) -> pb.Timing:
    """A request's timing as the router sends it: the timeline closed on its TTFT (unaccounted 8.5 ms)."""
    timing = pb.Timing(queue_s=0.040, prefill_s=0.085, kv_transfer_s=0.013, decode_queue_s=0.0015,
                       ttft_s=ttft_s, e2e_s=e2e_s)
    if timeline:
        tl = Timeline(intake_s=0.001, router_queue_s=0.030, dispatch_s=0.002, prefill_queue_s=0.010,
                      prefill_compute_s=0.080, sampling_s=0.005, kv_encode_s=0.004, kv_send_s=0.006,
                      kv_receive_s=0.002, adopt_s=0.001, first_event_s=0.0005)
        tl.close(ttft_s)
        timing.timeline.CopyFrom(tl.to_proto())
    return timing


def _completion(prompt: str, text: str, timeline: bool = True) -> Completion:
    return Completion(prompt, text, pb.Usage(prompt_tokens=10, completion_tokens=32), _timing(timeline=timeline))


def test_ttft_parts_hold_every_timeline_stage_once():
    grouped = [stage for _, stages in TTFT_PARTS for stage in stages]
    assert sorted(grouped) == sorted(STAGE_NAMES)


def test_stage_row_groups_a_real_timeline_into_parts_that_sum_to_ttft():
    row = StageRow.of(pb.Usage(prompt_tokens=10, completion_tokens=32), _timing())
    # queue 30 + 10, prefill 80 + 5, KV 4 + 6 + 2 + 1, other 1 + 2 + 0.5 + transit 0 + unaccounted 8.5 (ms)
    assert row.cells(1) == ("[1]", "10", "32", "40.0", "85.0", "13.0", "12.0", "150.0", "1.5", "20.0", "770.0")
    assert abs(sum(row.parts_s) - row.ttft_s) < 1e-9


def test_stage_row_without_a_timeline_leaves_the_parts_blank():
    row = StageRow.of(pb.Usage(prompt_tokens=10, completion_tokens=32), _timing(timeline=False))
    assert row.parts_s is None
    assert row.cells(2) == ("[2]", "10", "32", "-", "-", "-", "-", "150.0", "1.5", "20.0", "770.0")


def test_report_prints_texts_as_text_a_legend_and_one_table_row_per_request():
    completions = [_completion("A dictionary maps keys to values;", " first line\n\n   >>> indented"),
                   _completion("The os.path module", "\x1b[31mred\x1b[0m\tand a tab\r")]
    out = render_report(completions, width=100)
    lines = out.split("\n")

    assert "\x1b[" not in out and "\\n" not in out and "\r" not in out
    assert "[1] A dictionary maps keys to values;\n    |  first line\n    |\n    |    >>> indented\n" in out
    assert "    | \\x1b[31mred\\x1b[0m    and a tab\\x0d" in lines

    legend = [i for i, line in enumerate(lines) if line.startswith("legend: ")]
    assert len(legend) == 1
    assert " ".join(" ".join(lines[legend[0]:]).split()).startswith(LEGEND)
    for words in ("TTFT = time to first token", "TPOT = time per output token after the first", "queue = wait for"):
        assert words in LEGEND

    header = lines.index(next(line for line in lines if line.split() == list(HEADER)))
    rows = [line.split() for line in lines[header + 1:header + 3]]
    assert [r[0] for r in rows] == ["[1]", "[2]"]
    assert all(len(r) == len(HEADER) and all(NUMBER.match(cell) for cell in r[1:]) for r in rows)
    assert lines[header + 3].startswith("legend: ")
    assert "TTFT p50 150 ms, max 150 ms | TPOT p50 20.0 ms, max 20.0 ms" in lines


def test_long_completion_lines_wrap_at_the_width_keeping_their_indentation():
    text = "    " + " ".join(["word"] * 30)
    out = render_completion(3, "prompt", text, width=40).split("\n")
    assert out[0] == "[3] prompt"
    assert len(out) > 2 and all(len(line) <= 40 and line.startswith("    |     word") for line in out[1:])
    assert " ".join(line.removeprefix("    |") for line in out[1:]).split() == ["word"] * 30
