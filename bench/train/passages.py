"""The fixed held-out passages the quality gates score (`heldout_passages.json` beside the weights).

Token windows of `PASSAGE_TOKENS` from the held-out documents only, taken round-robin over
the documents (document i's k-th window is passage k * num_docs + i), so the set covers
every held-out document before it takes a second window from any.

    python -m bench.train.passages [--model-dir engine/weights/pydoc]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from engine.profile import HELDOUT_FILE, heldout_passages

PASSAGE_TOKENS = 193               # 128 prompt + 64 continuation inputs + 1 last target
NUM_PASSAGES = 64
FILE = HELDOUT_FILE


def select_passages(tok, heldout: list[tuple[str, str]], num: int = NUM_PASSAGES,
                    length: int = PASSAGE_TOKENS) -> list[dict]:
    docs = [(path, tok.encode(text, add_special_tokens=False).ids) for path, text in heldout]
    out, k = [], 0
    while len(out) < num and any(len(ids) >= (k + 1) * length for _, ids in docs):
        for path, ids in docs:
            window = ids[k * length:(k + 1) * length]
            if len(window) == length and len(out) < num:
                out.append({"doc": path, "offset": k * length, "token_ids": window})
        k += 1
    return out


def write_passages(model_dir: str, heldout: list[tuple[str, str]]) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    passages = select_passages(tok, heldout)
    path = os.path.join(model_dir, FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"passage_tokens": PASSAGE_TOKENS, "passages": passages}, f)
        f.write("\n")
    return path


def load_passages(model_dir: str) -> list[list[int]]:
    """Every held-out passage's token ids (`engine.profile.heldout_passages`, which the profiler reads too)."""
    return heldout_passages(model_dir)


def main(argv: list[str] | None = None) -> int:
    from bench.train.__main__ import DEFAULT_OUT
    from bench.train.corpus import load_corpus

    p = argparse.ArgumentParser(prog="python -m bench.train.passages", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=DEFAULT_OUT)
    p.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "pdserve", "corpus"))
    p.add_argument("--deb")
    args = p.parse_args(argv)
    print(write_passages(args.model_dir, load_corpus(args.cache, args.deb).heldout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
