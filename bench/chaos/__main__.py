"""``python -m bench.chaos`` (same as ``pdserve bench chaos``)."""
import sys

from bench.chaos import main

sys.exit(main())
