"""``python -m bench.transfer``: the KV transfer benchmark."""
import sys

from bench.transfer import main

sys.exit(main())
