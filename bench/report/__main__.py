"""`python -m bench.report [--preset small|tiny] [--out docs/benchmarks.md] [--img-dir docs/img]`"""
import sys

from bench.report.suite import main

sys.exit(main())
