"""The ``workload`` section: what traffic the planner sizes the pools for,
as token-length means or a histogram file of (input, output) lengths.

Histogram files:

* JSONL, one object per line: ``{"input_tokens": 2000, "output_tokens": 100}``
  with an optional ``"count"`` weight (default 1).
* CSV with a header row naming ``input_tokens,output_tokens[,count]``.
"""
from __future__ import annotations

import csv
import json
from typing import Optional

from pydantic import Field, ValidationInfo, field_validator, model_validator

from deploy.config.base import FieldProblem, Float, Int, Section, existing_file

DEFAULT_INPUT_TOKENS = 512
DEFAULT_OUTPUT_TOKENS = 128


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def read_histogram(path: str) -> list[tuple[int, int, int]]:
    """Rows ``(input_tokens, output_tokens, count)`` of a JSONL or CSV file.

    Raises:
        ValueError: one-line reason with ``file:line`` when a row is bad.
    """
    rows: list[tuple[int, int, int]] = []
    with open(path, newline="") as f:
        if path.endswith(".csv"):
            reader = csv.DictReader(f)
            missing = {"input_tokens", "output_tokens"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}:1: CSV header lacks {', '.join(sorted(missing))}")
            records = ((reader.line_num, rec) for rec in reader)
        else:
            records = ((num, _json_line(path, num, line))
                       for num, line in enumerate(f, 1) if line.strip())
            records = list(records)
        for line_num, rec in records:
            try:
                rows.append((_positive_int(rec.get("input_tokens"), "input_tokens"),
                             _positive_int(rec.get("output_tokens"), "output_tokens"),
                             _positive_int(rec.get("count", 1) or 1, "count")))
            except ValueError as exc:
                raise ValueError(f"{path}:{line_num}: {exc}") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def _json_line(path: str, num: int, line: str) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{num}: invalid JSON ({exc.msg})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{path}:{num}: expected a JSON object")
    return rec


def histogram_means(rows: list[tuple[int, int, int]]) -> tuple[int, int]:
    """Count-weighted mean input and output lengths, rounded to ints."""
    total = sum(count for _, _, count in rows)
    mean_in = sum(i * c for i, _, c in rows) / total
    mean_out = sum(o * c for _, o, c in rows) / total
    return max(1, round(mean_in)), max(1, round(mean_out))


class WorkloadSection(Section):
    """Traffic assumptions for ``pdserve plan`` and the autoscaler's start point.

    Give the two means, or ``histogram_file`` (the means are then computed
    from it), not both.
    """

    input_tokens_mean: Optional[Int] = Field(
        None, gt=0, description=f"Mean prompt length, tokens (default {DEFAULT_INPUT_TOKENS}).")
    output_tokens_mean: Optional[Int] = Field(
        None, gt=0, description=f"Mean output length, tokens (default {DEFAULT_OUTPUT_TOKENS}).")
    histogram_file: Optional[str] = Field(
        None, description="JSONL or CSV of input_tokens,output_tokens[,count] rows; "
        "relative to the config file.")
    arrival_rate_rps: Float = Field(1.0, gt=0, description="Mean request arrival rate, req/s.")

    @field_validator("histogram_file")
    @classmethod
    def _readable(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        path = existing_file(value, info)
        if path is not None:
            read_histogram(path)
        return path

    @model_validator(mode="after")
    def _fill_means(self) -> "WorkloadSection":
        if self.histogram_file is not None:
            means = histogram_means(read_histogram(self.histogram_file))
            # Values equal to the file's means are a round trip of this model.
            for key, mean in zip(("input_tokens_mean", "output_tokens_mean"), means):
                if getattr(self, key) not in (None, mean):
                    raise FieldProblem(key, "cannot be combined with workload.histogram_file")
            self.input_tokens_mean, self.output_tokens_mean = means
        else:
            if self.input_tokens_mean is None:
                self.input_tokens_mean = DEFAULT_INPUT_TOKENS
            if self.output_tokens_mean is None:
                self.output_tokens_mean = DEFAULT_OUTPUT_TOKENS
        return self
