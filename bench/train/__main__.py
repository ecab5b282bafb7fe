"""`python -m bench.train [--out DIR] [--steps N] ...`: rebuild the committed `pydoc` model.

Needs apt-get + dpkg-deb (Debian/Ubuntu) to fetch the corpus, or `--deb` with the package
file. Prints one progress line every 20 steps; about 45 minutes on one CPU thread.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from bench.train.corpus import load_corpus
from bench.train.trainer import Recipe, train
from engine.model.presets import TRAINED

DEFAULT_OUT = TRAINED["pydoc"]         # the committed model the engine serves (engine/weights/pydoc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="model directory to write (default: the committed one)")
    p.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "pdserve", "corpus"),
                   help="where the corpus package is downloaded and unpacked")
    p.add_argument("--deb", help="use this python3.11-doc .deb instead of `apt-get download`")
    for f in dataclasses.fields(Recipe):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)})
    try:
        corpus = load_corpus(args.cache, args.deb)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"corpus: {corpus.deb_name} sha256 {corpus.sha256[:16]}…, {len(corpus.train)} train docs "
          f"({corpus.num_train_bytes} bytes), {len(corpus.heldout)} held-out docs ({corpus.num_heldout_bytes} bytes)",
          flush=True)
    train(corpus, args.out, recipe, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
