"""`docs/benchmarks/serving.md`: the serving suite run once, written as Markdown and PNGs (`python -m bench.report`).

    suite.py     the experiments per serving variant, the machine, the driver and its flags
    markdown.py  the page
"""
from bench.report.markdown import render_markdown
from bench.report.suite import PRESETS, Plan, main

__all__ = ["PRESETS", "Plan", "main", "render_markdown"]
