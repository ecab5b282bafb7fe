"""Engine benchmark: our engine beside Hugging Face and the machine's own limits (`python -m bench.engine`).

    suite.py    the run: prefill, decode and serving-workload parts, the driver and its flags
    peers.py    what ours is measured against: matmul / memcpy limits and Hugging Face
    report.py   the tables (text and Markdown) and the targets PASS/MISS
"""
from bench.engine.suite import main

__all__ = ["main"]
