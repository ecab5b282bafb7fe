import sys

from bench.simulate.cli import main

sys.exit(main())
