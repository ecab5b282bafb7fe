"""`python -m bench.report [--preset small|tiny] [--out docs/benchmarks/serving.md] [--img-dir docs/benchmarks/img]`"""
import sys

from bench.report.suite import main

sys.exit(main())
