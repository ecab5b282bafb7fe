"""`python -m bench.serving --embedded|--address ... [--compare ...] [--sweep ...]` (same as `pdserve bench serve`)."""
import sys

from bench.serving.cli import main

sys.exit(main())
