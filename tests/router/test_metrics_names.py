"""Every name on /metrics passes `promtool check metrics` (router/metrics.py, DESIGN "Metrics").

The scrape is checked by a Python copy of promtool's naming rules always, and by promtool itself
when it is on PATH (Debian: `apt-get install prometheus`), so the test never passes on nothing.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request

import pytest

from proto.pdserve.v1 import generation_pb2 as pb
from router import ActorStats
from router.metrics import Metrics

# promtool's rules (client_golang promlint): base units, abbreviations, the reserved suffixes
BASE_UNITS = {"amperes", "bytes", "celsius", "grams", "joules", "kelvin", "meters", "metres", "seconds", "volts"}
OTHER_UNITS = {"minutes": "seconds", "hours": "seconds", "days": "seconds", "weeks": "seconds", "kelvins": "kelvin",
               "fahrenheit": "celsius", "rankine": "celsius", "inches": "meters", "yards": "meters",
               "miles": "meters", "bits": "bytes", "calories": "joules", "pounds": "grams", "ounces": "grams"}
UNIT_PREFIXES = ("pico", "nano", "micro", "milli", "centi", "deci", "deca", "hecto", "kilo", "kibi", "mega", "mibi",
                 "giga", "gibi", "tera", "tebi", "peta", "pebi")
UNIT_ABBREVIATIONS = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d")
TYPES_IN_NAMES = ("counter", "gauge", "histogram", "summary", "gaugehistogram")
CAMEL_CASE = re.compile(r"[a-z][A-Z]")
LABEL_NAMES = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=\"")


def _unit_problem(name: str) -> str | None:
    for part in name.split("_"):
        for prefix in ("", *UNIT_PREFIXES):
            unit = part[len(prefix):] if part.startswith(prefix) else None
            if unit in BASE_UNITS or unit in OTHER_UNITS:
                base = unit if unit in BASE_UNITS else OTHER_UNITS[unit]
                return None if part == base else f'use base unit "{base}" instead of "{part}"'
    return None


def lint(exposition: str) -> list[str]:
    """promtool's complaints about a text-format exposition, as "name: problem" lines."""
    types, helps, labels = {}, {}, {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("# HELP "):
            _, _, name, *text = line.split(" ", 3)
            helps[name] = text[0] if text else ""
        elif line and not line.startswith("#"):
            sample = re.split(r"[{ ]", line, maxsplit=1)[0]
            family = next((n for n in types if sample == n or sample.startswith(n + "_")), sample)
            labels.setdefault(family, set()).update(LABEL_NAMES.findall(line.split("}")[0]))
    problems = []
    for name, kind in types.items():
        found = []
        if not helps.get(name):
            found.append("no help text")
        if kind == "counter" and not name.endswith("_total"):
            found.append('counter metrics should have "_total" suffix')
        if kind not in ("counter", "untyped") and name.endswith("_total"):
            found.append('non-counter metrics should not have "_total" suffix')
        if kind != "untyped":
            if kind != "histogram" and name.endswith("_bucket"):
                found.append('non-histogram metrics should not have "_bucket" suffix')
            if kind not in ("histogram", "summary") and name.endswith(("_count", "_sum")):
                found.append("non-histogram and non-summary metrics should not have _count/_sum suffix")
        found += [f"metric name should not include type '{t}'" for t in TYPES_IN_NAMES
                  if f"_{t}_" in name.lower() or name.lower().endswith(f"_{t}")]
        if ":" in name:
            found.append("metric names should not contain ':'")
        if CAMEL_CASE.search(name) or any(CAMEL_CASE.search(label) for label in labels.get(name, ())):
            found.append("metric and label names should be written in 'snake_case' not 'camelCase'")
        if any(f"_{a}_" in name.lower() or name.lower().endswith(f"_{a}") for a in UNIT_ABBREVIATIONS):
            found.append("metric names should not contain abbreviated units")
        if unit := _unit_problem(name):
            found.append(unit)
        problems += [f"{name}: {problem}" for problem in found]
    return problems


@pytest.fixture
def scraped() -> str:
    """The real /metrics text after every hook and the stats poll have fed every family."""
    metrics = Metrics()
    metrics.request_finished("length", ttft_s=0.1, e2e_s=0.5, queue_s=0.01, num_output_tokens=4, itl_s=[0.1, 0.2])
    metrics.kv_transfer(0.01, 4096, 1100, "fp8")
    metrics.transfer_failed()
    metrics.local_prefill()
    metrics.prefix_hit_tokens(16)
    metrics.observe_stats([ActorStats("decode-0", pb.ACTOR_ROLE_DECODE, 64, 7, 0, 1, {"bad_hello": 1},
                                     spec_proposed_tokens=40, spec_accepted_tokens=30)])
    port = metrics.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return reply.read().decode()
    finally:
        metrics.stop()


def test_lint_finds_what_promtool_finds():
    bad = ("# HELP pdserve_kv_blocks_total KV blocks per actor.\n# TYPE pdserve_kv_blocks_total gauge\n"
           "pdserve_kv_blocks_total 3.0\n# HELP x_requests Requests.\n# TYPE x_requests counter\n"
           "x_requests 1.0\n# HELP x_latency_ms Latency.\n# TYPE x_latency_ms gauge\nx_latency_ms 1.0\n"
           "# HELP x_wait_milliseconds Wait.\n# TYPE x_wait_milliseconds gauge\nx_wait_milliseconds{actorId=\"a\"} 1\n")
    assert lint(bad) == [
        'pdserve_kv_blocks_total: non-counter metrics should not have "_total" suffix',
        'x_requests: counter metrics should have "_total" suffix',
        "x_latency_ms: metric names should not contain abbreviated units",
        "x_wait_milliseconds: metric and label names should be written in 'snake_case' not 'camelCase'",
        'x_wait_milliseconds: use base unit "seconds" instead of "milliseconds"',
    ]


def test_every_metric_name_passes_promtool_rules(scraped):
    families = [line.split(" ")[2] for line in scraped.splitlines() if line.startswith("# TYPE ")]
    assert {"pdserve_kv_blocks_capacity", "pdserve_kv_blocks_used", "pdserve_requests_total",
            "pdserve_ttft_seconds"} <= set(families)
    assert 'pdserve_kv_blocks_capacity{actor="decode-0",role="decode"} 64.0' in scraped
    assert 'pdserve_spec_accepted_tokens_total{actor="decode-0",role="decode"} 30.0' in scraped
    assert 'pdserve_spec_acceptance_ratio{actor="decode-0",role="decode"} 0.75' in scraped
    assert lint(scraped) == []


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not on PATH (Debian package prometheus)")
def test_promtool_check_metrics_passes(scraped):
    result = subprocess.run(["promtool", "check", "metrics"], input=scraped, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), result


def test_refused_connections_add_what_each_poll_adds_across_an_actor_restart():
    metrics = Metrics()
    for seen in ({"bad_token": 2}, {"bad_token": 5, "bad_hello": 1}, {"bad_token": 1}):   # restarted at the third
        metrics.observe_stats([ActorStats("decode-0", pb.ACTOR_ROLE_DECODE, 64, 0, 0, 0, seen)])
    counted = {s.labels["reason"]: s.value for s in metrics.refused_connections.collect()[0].samples
               if s.name.endswith("_total")}
    assert counted == {"bad_token": 6.0, "bad_hello": 1.0}


def test_speculative_counts_add_what_each_poll_adds_across_an_actor_restart():
    metrics = Metrics()
    for proposed, accepted in ((10, 4), (30, 20), (8, 2)):          # restarted at the third
        metrics.observe_stats([ActorStats("decode-0", pb.ACTOR_ROLE_DECODE, 64, 0, 0, 0, {},
                                          spec_proposed_tokens=proposed, spec_accepted_tokens=accepted)])
    totals = [next(s.value for s in c.collect()[0].samples if s.name.endswith("_total"))
              for c in (metrics.spec_proposed, metrics.spec_accepted)]
    assert totals == [38.0, 22.0]
    assert metrics.spec_acceptance.labels("decode-0", "decode")._value.get() == 0.25
