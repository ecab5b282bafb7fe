"""`python -m bench.engine [--model small] [--quick] [--json FILE] [--markdown FILE] ...`"""
import sys

from bench.engine.suite import main

sys.exit(main())
