"""Result files as strict JSON: what a browser's or jq's parser reads, not only Python's.

Figures of a run where nothing completed are nan, and a rate of "every request at once" is inf;
Python's json writes them as the bare words NaN and Infinity, which no strict parser accepts. They
are written as null.
"""
from __future__ import annotations

import json
import math


def clean_json(value: object) -> object:
    """`value` with every nan and inf float (at any depth of dicts, lists and tuples) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    return value


def write_json(path: str, value: object) -> None:
    """Write `value` to `path` as strict JSON (other objects as their str)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(clean_json(value), f, indent=1, default=str, allow_nan=False)
