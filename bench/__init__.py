"""Benchmarks: engine vs HF, KV transfer, serving (goodput, baselines), KV quality, stream latency.

Benchmarks run on one machine: a Ray instance they start keeps every listener
on 127.0.0.1 (Ray reads this setting when it is imported).
"""
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
