"""argparse types for the load generator's and the simulator's flags: a bad value is refused at once, naming
its flag (argparse prints ``argument --rate: …`` and exits 2), never run as something else or found broken
after a long run."""
from __future__ import annotations

import argparse
import math
import os


def _number(text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and math.isnan(value):
        raise argparse.ArgumentTypeError("nan is not a number")
    return value


def positive_int(text: str) -> int:
    """An integer ≥ 1 (requests, turns, devices, lengths)."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer ≥ 0."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (scales, seconds, SLOs)."""
    value = _number(text, float)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number ≥ 0."""
    value = _number(text, float)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def request_rate(text: str) -> float:
    """Requests per second: above 0, or inf (every request at once)."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0 (or inf: every request at once), got {text}")
    return value


def output_file(text: str) -> str:
    """A file to write at the end: its directory must exist now, not after the run."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: no directory {folder} to write it in")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    return text


def float_list(flag: str, text: str) -> list[float]:
    """Comma-separated finite numbers above 0 (a sweep's rates, lengths or concurrencies); ValueError naming
    `flag`."""
    values = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            values.append(positive_float(part.strip()))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{flag}: {e}") from None
    return values


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers ≥ 1 (prompt lengths), at least one."""
    values = tuple(positive_int(part.strip()) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError("give at least one integer")
    return values
