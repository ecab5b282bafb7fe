"""Benchmarks, one sub-package each: engine/ (engine vs HF), transfer/ (KV transfer), serving/
(latency, goodput, baselines, plan check, stream latency), report/ (docs/benchmarks/serving.md); kv_quality.py
(fp8 KV accuracy).

Benchmarks run on one machine: a Ray instance they start keeps every listener
on 127.0.0.1 (Ray reads this setting when it is imported).
"""
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
